"""The real-fault corpus's held-out part (README.md here), installed as ``lockstep.holdout`` (package data, so that
``lockstep evaluate --real --part holdout`` works in a non-editable install)."""
