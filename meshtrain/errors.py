"""The root of meshtrain's exception tree.

Every error a user or a remote peer can cause is a subclass of `MeshtrainError` with a message
that says what went wrong and what to do, so the CLI can print one line instead of a traceback.
Each layer defines its own subclasses next to the protocol that raises them.
"""


class MeshtrainError(Exception):
    """Base class of all errors meshtrain raises on purpose."""


class ConfigError(MeshtrainError):
    """Bad user input: a config value, a flag, a file that cannot be used."""


def meshtrain_error_in(eg: BaseExceptionGroup) -> MeshtrainError | None:
    """trio nurseries wrap errors in exception groups: find ours inside, if that is what ended us."""
    for e in eg.exceptions:
        found = meshtrain_error_in(e) if isinstance(e, BaseExceptionGroup) else e
        if isinstance(found, MeshtrainError):
            return found
    return None
