"""What a pipeline swarm's peers say to each other through their membership records.

Problem. A pipeline swarm has no coordinator: placement, the epoch every peer runs, who is
ready, which step a stage's state is offered at and who asked for an epoch end are all read from
the peers' membership records (crdt/swarm_records.py), which every peer gossips. node/stages/peer.py
and node/stages/handover.py decide with them; this module only writes ours and reads the others'.

Design. Our record's capabilities carry a `pipeline` entry beside the others (the proof of work):

    {"stage", "fwd", "step", "epoch", "ready", "offer", "cut"}

- stage: the stage we train (None: none yet); fwd: our measured forward seconds per microbatch;
  step: the swarm step our stage has trained to (0: fresh, placement may move us for free);
- epoch: the key of the placement we agree to run (node/stages/peer.py `Epoch`); ready: the
  key of the epoch whose runtime we serve;
- offer: the step of the stage state we publish (node/stages/state.py), None when we hold none;
- cut: a counter that asks the origins to end the running epoch (`meshtrain export`).

`announce` merges changes into ours and heartbeats at once when anything changed (the others
poll every `AGREE_POLL`: an agreement takes a gossip round and a poll). Others' records are read
through `placement.announced`, which checks every field: a hostile record cannot make placement
or a poll raise; what fails a check reads as not announced.

`finished` reads every record, live or left, for the swarm's end: a late joiner that came after
the others trained the spec's last step would otherwise wait for them for ever.

Not here: what the values mean to placement (pipeline/placement.py) or when we change them.
"""

from __future__ import annotations

from typing import Any

from meshtrain.crdt.swarm_view import PeerInfo, SwarmView
from meshtrain.node.presence import PeerPresence
from meshtrain.pipeline.placement import Member, announced


class PipelineAnnouncements:
    """Our `pipeline` capabilities, and the others' as placement sees them.

    presence: the node's (entered: its view exists). num_stages: the spec's stages (an announced
    stage out of range is ignored)."""

    def __init__(self, presence: PeerPresence, num_stages: int) -> None:
        self.presence = presence
        self.me = presence.me
        self.num_stages = num_stages
        self.own: dict[str, Any] = {}

    def _view(self) -> SwarmView:
        view = self.presence.view
        if view is None:
            raise RuntimeError("the node's presence is not entered")
        return view

    def announce(self, **changes: Any) -> None:
        """Merge `changes` into our announcement; heartbeat at once if it changed."""
        caps = {**self.own, **changes}
        if caps == self.own:
            return
        self.own = caps
        view = self._view()
        view.capabilities = {**view.capabilities, "pipeline": caps}
        view.heartbeat()

    def of(self, peer: str) -> dict[str, Any]:
        """What `peer` announces (checked; empty if it is not a live member)."""
        if peer == self.me:
            return self.own
        rec = next((p for p in self._view().live_peers() if p.peer_id == peer), None)
        return announced(rec.capabilities, self.num_stages) if rec is not None else {}

    def members(self) -> dict[str, Member]:
        """Every live trainer we are connected to, and us, as placement sees them."""
        live = set(self.presence.candidates())
        out: dict[str, Member] = {}
        for p in self._view().live_peers():
            if p.peer_id not in live:
                continue
            caps = self.own if p.peer_id == self.me else announced(p.capabilities, self.num_stages)
            out[p.peer_id] = Member(p.peer_id, caps.get("stage"), caps.get("fwd"), fresh=caps.get("step", 0) == 0)
        return out

    def finished(self, last: int) -> str | None:
        """A peer whose record, live or left, announces the swarm's `last` step (as its step or
        the step of the state it offers), unless a live trainer still trains: it announces less
        and has trained (step > 0) or runs an epoch (a swarm's first epoch announces step 0). The
        swarm trained all its steps. None otherwise, or if `last` is 0 (no end). One hostile
        record cannot end a joiner's wait while honest peers still train; a joiner still waiting
        for peers (step 0, no epoch) is not counted as training."""
        if last <= 0:
            return None
        view = self._view()
        done: str | None = None
        for rec in view.peers():
            if rec.peer_id == self.me:
                continue
            caps = announced(rec.capabilities, self.num_stages)
            reached = max(caps.get("step", 0), caps.get("offer", 0))
            if reached >= last:
                done = done or rec.peer_id
            elif (
                (reached > 0 or "epoch" in caps or "ready" in caps)
                and rec.role == "trainer"
                and view.is_live(rec.peer_id)
            ):
                return None
        return done

    def stage_of(self, peer: PeerInfo) -> int | None:
        """The stage a member's record announces (not ours: the caller knows its own)."""
        return announced(peer.capabilities, self.num_stages).get("stage")
