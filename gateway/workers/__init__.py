"""Several gateway processes behind one port (`gateway serve --workers N`, on PostgreSQL)."""
