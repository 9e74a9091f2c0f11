"""Runs hivemind side by side with us, in hivemind's own virtualenv.

hivemind 1.1.12 is asyncio-based, brings its own Go daemon (`p2pd`, inside its PyPI wheel) and pins
its own dependencies, so it never shares our venv; this module only uses the standard library and
never imports hivemind.

- `ensure_hivemind_venv()` returns the venv directory, creating `<project>/.venv-hivemind` on first
  use with `pip install torch==2.13.0 hivemind==1.1.12` (torch pinned: 2.13.0 installs from the
  CPU wheel on disk, an unpinned torch pulls a multi-GB CUDA build; ~90 s, 1.2 GB), progress on
  stderr. Set MESHTRAIN_HIVEMIND_VENV to use (or create) a venv elsewhere. It returns None when the
  install fails; `hivemind_venv_error()` then says why.
- `run_probe(script, args, timeout)` runs `scripts/<script>` with that venv's python in its own
  process group, kills the whole group (workers and their p2pd daemons) when it finishes or times
  out, and returns the JSON object on the script's last stdout line, or {"error": reason}. It
  never raises.
- `kill_tree(pid)` (stdlib, Linux /proc) is shared with the probes, which run in hivemind's venv and
  import it from this directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
HIVEMIND_VERSION = "1.1.12"
TORCH_VERSION = "2.13.0"
ENV_VAR = "MESHTRAIN_HIVEMIND_VENV"

_last_error: str | None = None


def hivemind_venv_error() -> str | None:
    """Why the last `ensure_hivemind_venv()` returned None (None if it did not)."""
    return _last_error


def _say(msg: str) -> None:
    print(f"[hivemind] {msg}", file=sys.stderr, flush=True)


def venv_dir() -> Path:
    """Where hivemind's venv is (or would be created): $MESHTRAIN_HIVEMIND_VENV, else <project>/.venv-hivemind."""
    return Path(os.environ.get(ENV_VAR) or ROOT / ".venv-hivemind").expanduser().resolve()


def _clean_env() -> dict[str, str]:
    """Our environment minus what would leak our venv into hivemind's interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _installed(python: Path) -> str | None:
    """None if `python` has hivemind==1.1.12, torch==2.13.0 and the p2pd binary; else what is wrong.

    Reads package metadata only (no torch import), so it takes ~50 ms.
    """
    if not python.exists():
        return f"{python} does not exist"
    check = (
        "import importlib.metadata as m, importlib.util as u, os, sys\n"
        "try:\n"
        "    h, t = m.version('hivemind'), m.version('torch')\n"
        "except m.PackageNotFoundError as e:\n"
        "    sys.exit(f'missing {e}')\n"
        "s = u.find_spec('hivemind')  # finds the package without importing it (and torch)\n"
        "p = s and s.submodule_search_locations and os.path.join(list(s.submodule_search_locations)[0],"
        " 'hivemind_cli', 'p2pd')\n"
        f"if h != {HIVEMIND_VERSION!r} or t.split('+')[0] != {TORCH_VERSION!r}:\n"
        "    sys.exit(f'hivemind {h}, torch {t} installed')\n"
        "if not p or not os.access(p, os.X_OK):\n"
        "    sys.exit('hivemind/hivemind_cli/p2pd missing')\n"
    )
    try:
        r = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=60, env=_clean_env())
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run {python}: {e}"
    if r.returncode:
        return (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    return None


_PROGRESS = ("Collecting", "Processing", "Downloading", "Installing", "Successfully", "ERROR", "error")


def _run_logged(cmd: list[str], timeout: float) -> str | None:
    """Run `cmd` with its output on our stderr; None on success, else a one-line reason."""
    tail: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_env())
    except OSError as e:
        return f"cannot run {cmd[0]}: {e}"
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                if line.startswith(_PROGRESS):  # pip's steps, not its hundred "already satisfied" lines
                    print(f"[hivemind]   {line[:160]}", file=sys.stderr, flush=True)
                tail = (tail + [line])[-5:]
            if time.monotonic() > deadline:
                proc.kill()
                return f"{' '.join(cmd[2:4])} timed out after {timeout:g} s"
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc:
        why = next((x for x in reversed(tail) if "error" in x.lower()), tail[-1] if tail else "")
        return f"{' '.join(cmd[2:4])} exited {rc}: {why}"[:300]
    return None


def ensure_hivemind_venv() -> Path | None:
    """The venv directory with hivemind 1.1.12 + torch 2.13.0, creating it if needed; None on failure.

    Location: $MESHTRAIN_HIVEMIND_VENV, else <project>/.venv-hivemind. An existing venv that lacks
    the right versions is (re)installed into; concurrent callers serialise on a lock file.
    """
    global _last_error
    _last_error = None
    venv = venv_dir()
    python = venv / "bin" / "python"
    if _installed(python) is None:
        return venv
    try:
        venv.mkdir(parents=True, exist_ok=True)  # `python -m venv` accepts an existing directory
        with open(venv / ".meshtrain-install.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another benchmark may be installing the same venv
            return _install(venv, python)
    except OSError as e:
        _last_error = f"cannot create or lock {venv}: {e}"
        return None


def _install(venv: Path, python: Path) -> Path | None:
    global _last_error
    if _installed(python) is None:  # someone else finished it while we waited for the lock
        return venv
    t0 = time.monotonic()
    if not python.exists():
        _say(f"creating venv {venv} ...")
        why = _run_logged([sys.executable, "-m", "venv", str(venv)], timeout=300)
        if why:
            _last_error = f"could not create {venv}: {why}"
            _say(_last_error)
            return None
    _say(f"pip install torch=={TORCH_VERSION} hivemind=={HIVEMIND_VERSION} into {venv} (~2 min, 1.2 GB) ...")
    why = _run_logged(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--progress-bar",
            "off",
            f"torch=={TORCH_VERSION}",
            f"hivemind=={HIVEMIND_VERSION}",
        ],
        timeout=1800,
    )
    why = why or _installed(python)
    if why:
        _last_error = f"could not install hivemind: {why}"
        _say(_last_error)
        return None
    _say(f"hivemind venv ready in {time.monotonic() - t0:.0f} s")
    return venv


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def kill_tree(pid: int, include_self: bool = True) -> None:
    """SIGKILL `pid`'s descendants (and `pid` itself if include_self); never raises."""
    try:
        kids = _children()
        todo, found = [pid], []
        while todo:
            p = todo.pop()
            found.append(p)
            todo.extend(kids.get(p, []))
        for p in found:
            if p != pid or include_self:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
    except Exception:  # noqa: S110  (best effort, never raises)
        pass


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


def run_probe(script_name: str, args: list[str], timeout: float) -> dict:
    """Run scripts/<script_name> in hivemind's venv; its last stdout line as a dict, or {"error": ...}."""
    proc = None
    try:
        venv = ensure_hivemind_venv()
        if venv is None:
            return {"error": _one_line(hivemind_venv_error() or "hivemind venv unavailable")}
        cmd = [str(venv / "bin" / "python"), str(SCRIPTS / script_name), *map(str, args)]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_clean_env(),
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"{script_name} timed out after {timeout:g} s"}
        lines = [x for x in out.splitlines() if x.strip()]
        if not lines:
            errs = [x for x in err.splitlines() if x.strip()]
            return {
                "error": _one_line(f"{script_name} exited {proc.returncode} with no output: {errs[-1] if errs else ''}")
            }
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            return {"error": _one_line(f"{script_name} printed no JSON: {lines[-1]}")}
        if not isinstance(result, dict):
            return {"error": _one_line(f"{script_name} printed {type(result).__name__}, not an object")}
        if "error" in result:
            result["error"] = _one_line(str(result["error"]))
        return result
    except Exception as e:  # never raise: the caller reports the reason next to our own numbers
        return {"error": _one_line(f"{script_name}: {type(e).__name__}: {e}")}
    finally:
        if proc is not None:
            # the probe's workers and their p2pd daemons share its process group
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.communicate(timeout=10)


if __name__ == "__main__":  # python scripts/bench/hivemind_anchor.py <probe.py> [args...]: create the venv, run a probe
    if len(sys.argv) < 2:
        print(ensure_hivemind_venv() or hivemind_venv_error())
    else:
        print(json.dumps(run_probe(sys.argv[1], sys.argv[2:], timeout=1800)))
