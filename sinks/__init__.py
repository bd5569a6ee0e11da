"""The sink side: the DuckDB sink (:mod:`.sink`), its HTTP server and clients (:mod:`.http`), the store
(:mod:`.store`), paging (:mod:`.paging`) and the report (:mod:`.report`)."""
