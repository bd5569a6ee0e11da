"""The real-fault corpus (README.md here), installed as ``lockstep.corpus`` (package data, so that
``lockstep evaluate --real`` works in a non-editable install)."""
