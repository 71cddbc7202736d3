"""What names the LLMDeployment API on the API server: group, version, kind, plural and the CRD's name."""

from __future__ import annotations

GROUP = "kubellm.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMDeployment"
LIST_KIND = "LLMDeploymentList"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ("llmd",)
CATEGORIES = ("kubellm",)
CRD_NAME = f"{PLURAL}.{GROUP}"
