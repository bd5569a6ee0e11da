"""The diagnosis: a pure, vectorised library (numpy / pyarrow; no Kafka, no files).

The stream processor, the offline ``lockstep diagnose`` command and the
benchmarks all call it:

    frame = StepFrame.from_tables(...)          # every worker's function table for one step
    result = analyze_step(frame, policy.diagnosis)   # peer comparison within the step
    d = diagnose_window(info, [results...], policy, now=..., history=h)  # persistence, topology, causes, impact
    h = d.history                               # the job's baseline, for its next window
"""

from .frame import StepFrame, peer_group_key
from .handoff import step_report, step_result
from .history import HistoryError, JobHistory
from .step import StepResult, analyze_step
from .window import WindowDiagnosis, WindowInfo, diagnose_window, window_report

__all__ = [
    "HistoryError",
    "JobHistory",
    "StepFrame",
    "StepResult",
    "WindowDiagnosis",
    "WindowInfo",
    "analyze_step",
    "diagnose_window",
    "peer_group_key",
    "step_report",
    "step_result",
    "window_report",
]
