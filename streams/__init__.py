"""The stream processor: the pure diagnosis (:mod:`.diagnosis`), the detector (:mod:`.detector`), the assemblers (:mod:`.windows`), the stages (:mod:`.stages`) and the faust adapter (:mod:`.app`)."""
