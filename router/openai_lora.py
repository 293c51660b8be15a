"""LoRA adapters on the OpenAI-compatible API, with vLLM's shapes.

    GET  /v1/models                 the base model, then each adapter as a model whose ``parent`` is it
    POST /v1/load_lora_adapter      {"lora_name": ..., "lora_path": ...}   every node loads the folder
    POST /v1/unload_lora_adapter    {"lora_name": ...}                     every node stops serving it

A request selects an adapter by naming it in ``model``.  The load and unload calls are refused (400,
as vLLM answers) unless the router runs with ``--allow-runtime-lora``; like every call they need an API
key where keys are required.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from engine.lora.adapter import AdapterError, check_name
from router.adapters import RouterAdapters
from router.auth import Caller
from router.openai_errors import ApiError
from router.openai_schema import WholeBody
from router.tokenizer import RouterModel
from serving.errors import ServingError


class LoadLoraAdapterRequest(WholeBody):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)
    # vLLM's: false refuses a name already served (vLLM's default); true, or unset (pdkv's default),
    # replaces it.
    load_inplace: bool | None = None


class UnloadLoraAdapterRequest(WholeBody):
    # vLLM's lora_int_id is not a field: names identify adapters here (it is refused, naming it).
    lora_name: str = Field(min_length=1, max_length=128)


def adapter_cards(
    model: RouterModel, adapters: RouterAdapters | None, created: int, context: int = 0
) -> list[dict[str, Any]]:
    """Each served adapter as ``/v1/models`` lists it (vLLM: ``parent`` and ``root``)."""
    if adapters is None:
        return []
    return [
        {
            "id": a.name,
            "object": "model",
            "created": created,
            "owned_by": "pdkv",
            "root": a.name,
            "parent": model.name,
            "max_model_len": context or model.context_length,
            "lora_digest": a.digest.hex(),
            "lora_max_rank": a.max_rank,
            "lora_modules": list(a.modules),
        }
        for a in adapters.info()
    ]


def add_lora_routes(
    app: Any, adapters: RouterAdapters | None, authenticated: Any, base_name: str | None = None
) -> None:
    """The load and unload routes; ``base_name``: the served model's name, which no adapter may take
    (requests naming it run the base model: the adapter could never be reached)."""

    @app.post("/v1/load_lora_adapter")
    async def _load(body: LoadLoraAdapterRequest, caller: Any = authenticated) -> dict[str, Any]:
        target = _require(adapters)
        _may_manage(caller)
        try:
            check_name(body.lora_name)  # the nodes' own rule, here so that the refusal names lora_name
        except AdapterError as exc:
            raise ApiError.invalid("lora_name", str(exc)) from None
        if body.lora_name == base_name:
            raise ApiError.invalid("lora_name", f"{body.lora_name!r} is the base model's name: pick another")
        if body.load_inplace is False and body.lora_name in target.served():
            raise ApiError.invalid(
                "lora_name",
                f"adapter {body.lora_name!r} is already loaded; send load_inplace: true to replace it",
            )
        try:
            info = await asyncio.to_thread(target.load, body.lora_name, body.lora_path)
        except ServingError as exc:
            raise _refusal(exc) from None
        return {
            "object": "lora_adapter",
            "lora_name": info.name,
            "lora_digest": info.digest.hex(),
            "message": f"Success: LoRA adapter '{info.name}' added successfully.",
        }

    @app.post("/v1/unload_lora_adapter")
    async def _unload(body: UnloadLoraAdapterRequest, caller: Any = authenticated) -> dict[str, Any]:
        target = _require(adapters)
        _may_manage(caller)
        try:
            await asyncio.to_thread(target.unload, body.lora_name)
        except ServingError as exc:
            raise _refusal(exc) from None
        return {
            "object": "lora_adapter",
            "lora_name": body.lora_name,
            "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
        }


def _require(adapters: RouterAdapters | None) -> RouterAdapters:
    if adapters is None:
        raise ApiError(400, "this server serves no adapters", kind="invalid_request_error")
    return adapters


def _may_manage(caller: Caller) -> None:
    try:
        caller.may_manage_adapters()
    except ServingError as exc:
        raise ApiError.from_serving(exc) from None


def _refusal(exc: ServingError) -> ApiError:
    """An unknown name is a 404; a folder the nodes refuse a 400 naming ``lora_path`` (the message says
    which field of it); the switch off a 400; anything else as its status maps."""
    code = exc.code.name
    if code == "NOT_FOUND":
        return ApiError(404, exc.message, kind="not_found_error", param="lora_name", code="lora_not_found")
    if code == "INVALID_ARGUMENT":
        return ApiError(400, exc.message, kind="invalid_request_error", param="lora_path")
    if code == "FAILED_PRECONDITION":
        return ApiError(400, exc.message, kind="invalid_request_error")
    return ApiError.from_serving(exc)
