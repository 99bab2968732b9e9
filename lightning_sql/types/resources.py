"""Tunable resources shared between the algorithm and the runners (docs/store-contract.md §1.9)."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from .core import AttemptedRollout

__all__ = [
    "Resource",
    "LLM",
    "ProxyLLM",
    "PromptTemplate",
    "ResourceUnion",
    "NamedResources",
    "ResourcesUpdate",
]

logger = logging.getLogger(__name__)


class Resource(BaseModel):
    """Base class of tunable resources distributed to runners."""

    resource_type: Any
    """The discriminator of the concrete resource class."""


class LLM(Resource):
    """An LLM endpoint and its configuration."""

    resource_type: Literal["llm"] = "llm"
    endpoint: str
    """The URL of the LLM API endpoint."""
    model: str
    """The identifier of the model to use (e.g. 'gpt-4o')."""
    api_key: str | None = None
    """Optional secret used to authenticate requests."""
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)
    """Inference hyperparameters such as temperature or top_p."""

    def get_base_url(self, *args: Any, **kwargs: Any) -> str:
        """Return the base URL for OpenAI-compatible clients (the endpoint)."""
        return self.__dict__["endpoint"]


class ProxyLLM(LLM):
    """An LLM behind the LLM proxy, which routes each request by the rollout and attempt in its URL."""

    resource_type: Literal["proxy_llm"] = "proxy_llm"  # type: ignore[assignment]

    # Only reads through normal attribute access warn. Pydantic (model_dump, repr, equality, copy, pickle)
    # reads the instance __dict__ directly, and so does get_base_url, so none of them triggers the warning.
    def __getattribute__(self, name: str) -> Any:
        if name == "endpoint":
            logger.warning(
                "Accessing 'endpoint' directly on ProxyLLM is discouraged. "
                "Use 'get_base_url(rollout_id, attempt_id)' instead to get the properly formatted endpoint."
            )
        return super().__getattribute__(name)

    def with_attempted_rollout(self, rollout: AttemptedRollout) -> LLM:
        """Return a plain `LLM` whose endpoint is routed to `rollout` and its current attempt."""
        return LLM(
            endpoint=self.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id),
            model=self.model,
            sampling_parameters=self.sampling_parameters,
            api_key=self.api_key,
        )

    def get_base_url(self, rollout_id: str | None, attempt_id: str | None) -> str:  # type: ignore[override]
        """Return the endpoint routed to one rollout attempt: `.../rollout/<rid>/attempt/<aid>[/v1]`.

        Both ids None returns the raw endpoint.

        Raises:
            ValueError: exactly one of `rollout_id` and `attempt_id` is given.
        """
        endpoint: str = self.__dict__["endpoint"]
        if rollout_id is None and attempt_id is None:
            return endpoint
        if not (isinstance(rollout_id, str) and isinstance(attempt_id, str)):
            raise ValueError("rollout_id and attempt_id must be strings or all be empty")
        prefix = endpoint[:-1] if endpoint.endswith("/") else endpoint
        has_v1 = prefix.endswith("/v1")
        if has_v1:
            prefix = prefix[:-3]
        prefix += f"/rollout/{rollout_id}/attempt/{attempt_id}"
        return prefix + "/v1" if has_v1 else prefix


class PromptTemplate(Resource):
    """A reusable prompt template."""

    resource_type: Literal["prompt_template"] = "prompt_template"
    template: str
    """The template text; its syntax depends on `engine`."""
    engine: Literal["jinja", "f-string", "poml"]
    """The templating engine that renders the prompt."""

    def format(self, **kwargs: Any) -> str:
        """Return the template rendered with `kwargs` (f-string engine only).

        Raises:
            NotImplementedError: the engine is not `"f-string"`.
        """
        if self.engine == "f-string":
            return self.template.format(**kwargs)
        raise NotImplementedError(
            "Formatting prompt templates for non-f-string engines with format() helper is not supported yet."
        )


ResourceUnion = Annotated[LLM | ProxyLLM | PromptTemplate, Field(discriminator="resource_type")]
"""A concrete resource, told apart by `resource_type`."""
NamedResources = dict[str, ResourceUnion]
"""Mapping from resource names to their resources."""


class ResourcesUpdate(BaseModel):
    """A versioned snapshot of named resources."""

    resources_id: str
    """The id of the resources."""
    create_time: float
    """When the resources id was first stored."""
    update_time: float
    """When this version was stored."""
    version: int
    """Version of the resources under this id, starting at 1."""
    resources: NamedResources
    """The named resources (validating a dict re-materialises the concrete classes)."""
