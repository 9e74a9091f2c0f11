"""pipeline layer of meshtrain (see shared/ARCHITECTURE.md)."""
