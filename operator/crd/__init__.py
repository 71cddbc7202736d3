"""The LLMDeployment CRD and its API reference, generated from the pydantic models in :mod:`kubellm.operator.api`:
:mod:`.schema` (the CustomResourceDefinition, ``kubellm crd``) and :mod:`.reference` (docs/crd-reference.md,
``kubellm crd --reference``)."""
