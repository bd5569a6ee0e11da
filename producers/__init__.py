"""The producers: the host agent (:mod:`.agent`) and the simulated fleet (:mod:`.simulator`)."""
