"""The status of an LLMDeployment from what the operator observed: pure functions, no API calls. :mod:`.observe`
(conditions, fields and Events), :mod:`.rollout_guard` (rollouts blocked for want of a spare GPU),
:mod:`.gateway` (the InferencePool's parents)."""
