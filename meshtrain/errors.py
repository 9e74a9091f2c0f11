"""The root of meshtrain's exception tree.

Every error a user or a remote peer can cause is a subclass of `MeshtrainError` with a message
that says what went wrong and what to do, so the CLI can print one line instead of a traceback.
Each layer defines its own subclasses next to the protocol that raises them.
"""


class MeshtrainError(Exception):
    """Base class of all errors meshtrain raises on purpose."""


class ConfigError(MeshtrainError):
    """Bad user input: a config value, a flag, a file that cannot be used."""
