"""transport layer of meshtrain (see docs/architecture.md)."""
