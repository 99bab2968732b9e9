"""An OpenAI-compatible LLM proxy that records every call, with its token ids, as a span in the store.

``LLMProxy`` (Agent-Lightning 0.3's surface) is importable without the HTTP stack; ``start()`` needs the
``proxy`` extra (Starlette, uvicorn, httpx).  Modules: ``config`` (model list, balancing, settings),
``app`` (the ASGI app), ``upstream`` (forwarding, retries), ``streaming`` (stream assembly), ``spans``
and ``recorder`` (what is stored, and where), ``server`` (launch modes), ``testing`` (a stand-in model
server).
"""

from lightning_sql.llm_proxy.config import ModelConfig
from lightning_sql.llm_proxy.proxy import LLMProxy

__all__ = ["LLMProxy", "ModelConfig"]
