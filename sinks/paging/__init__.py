"""Paging: incidents from findings (:mod:`.incidents`), what a page says (:mod:`.pages`), where it goes
(:mod:`.routes`), and its delivery from the sink (:mod:`.pager`)."""
