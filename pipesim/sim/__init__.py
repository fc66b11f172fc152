"""The simulator: a SimPy discrete-event model of a lowered schedule, and what it leaves.

``engine`` runs one step (``dataflow`` walks each rank's rows), ``memory`` replays the
activation timeline, ``spans`` / ``trace`` / ``result`` / ``metrics`` turn the step into the
trace format shared with measured runs, ``chrome`` and ``plot`` draw it, ``sweep`` runs many
configurations, ``calibrate`` fits a :class:`pipesim.plan.costs.CostModel` back from a trace,
and ``plan_report`` simulates a :class:`pipesim.Plan` into its throughput and memory report.
Below it: the schedule IR and the cost model (:mod:`pipesim.plan`); above it: zb-auto, the
planner and the command line.
"""
