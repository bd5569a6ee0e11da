"""The evaluation suites, installed as ``lockstep.suites`` (package data, so that a non-editable install has them):
``standard/`` (the simulated scenarios ``lockstep evaluate`` scores) and ``steptimes/`` (recorded step times of real
jobs, ``lockstep evaluate --detector``)."""
