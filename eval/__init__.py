"""The language-compliance reward, the eval (engines, runner, the 50-question set), the gate
and the reports."""
