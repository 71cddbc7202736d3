"""kubellm operator: the LLMDeployment API, rendering and reconciliation."""
