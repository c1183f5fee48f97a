"""The eval (engines, runner, the 50-question set), the gate and the reports."""
