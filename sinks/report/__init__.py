"""The report: typed rows to one HTML page (:mod:`.page`, pure) and those rows read from the store with SQL
(:mod:`.data`)."""
