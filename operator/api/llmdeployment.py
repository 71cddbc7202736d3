"""The LLMDeployment object: metadata, spec and status."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kubellm.operator.api.identity import API_VERSION, KIND
from kubellm.operator.api.rules import KubeModel
from kubellm.operator.api.spec import LLMDeploymentSpec
from kubellm.operator.api.status import LLMDeploymentStatus


class LLMDeployment(KubeModel):
    """LLMDeployment serves one LLM with the kubellm runtime: pods, a Service, probes that run a real
    inference, draining rollouts and queue-depth autoscaling."""

    api_version: Literal["kubellm.io/v1alpha1"] = API_VERSION
    kind: Literal["LLMDeployment"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: LLMDeploymentSpec
    status: LLMDeploymentStatus | None = None

    @property
    def name(self) -> str | None:
        return self.metadata.get("name")

    @property
    def namespace(self) -> str | None:
        return self.metadata.get("namespace")
