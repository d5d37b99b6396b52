"""Preemption: the one SIGTERM owner (:mod:`.signals`) and the cross-rank stop vote (:mod:`.vote`).

This layer sits below ``checkpoint/`` and ``runtime/``: both ask it whether a notice arrived and whether
every rank agrees to stop.

    >>> from vertexrt.preemption.signals import preemption_signal
    >>> preemption_signal().requested
    False
"""
