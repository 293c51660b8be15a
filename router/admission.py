"""One way in: what a client asked for, whatever the front end, admitted in one place.

    gRPC GenerateRequest ──servicer.py──┐
                                        ├─▶ GenerationRequest ──admit()──▶ AdmittedRequest ──▶ pipeline
    HTTP JSON body ───openai_requests.py┘

A front end only converts: its request becomes a ``GenerationRequest`` (the prompt as text, messages or
token ids; the sampling fields the client set, by ``SamplingParams``'s names; the client's cache salt;
stream options; how the front end spells each field in an error).  ``Admission.admit`` does the rest, the
same for both: it renders the chat template, tokenizes, checks the vocabulary and the model's context,
applies the defaults and the router's ``max_tokens_limit``, builds the validated ``SamplingParams`` and
derives the cache salt from the caller's tenant.  A refusal is ``InvalidField``: INVALID_ARGUMENT on
gRPC, HTTP 400 with ``param`` on the OpenAI API, naming the field as that client spells it.

Defaults (both front ends):

    max_tokens unset    a conversation (messages): up to MAX_DEFAULT_CHAT_TOKENS, an end of turn ends it
                        first; a text or token-id prompt: DEFAULT_MAX_TOKENS (OpenAI's completions
                        default).  Either is cut to the room the context leaves and to max_tokens_limit.
    max_tokens set      refused when over max_tokens_limit, or when prompt + max_tokens exceed the
                        model's context (max_model_len).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from engine.chat_template import ChatTemplateError
from engine.hashing import AdapterId
from engine.sampling_params import SamplingParams
from engine.structured import GrammarError, StructuredOutput
from router.adapters import RouterAdapters
from router.auth import Caller
from router.tokenizer import RouterModel
from router.tool_calls import (
    ToolCall,
    ToolChoice,
    ToolFieldError,
    ToolFields,
    ToolPlan,
    ToolSpec,
    check_choice,
    check_history,
    check_tools,
    tool_format,
)
from router.tool_parser import ToolParser
from router.tool_prompt import constraint, template_inputs
from serving.errors import ServingError

# A text or token-id prompt without max_tokens generates this many tokens (OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16
# A conversation without max_tokens runs to its end of turn, or to the context's end, capped here.
MAX_DEFAULT_CHAT_TOKENS = 4096
# What makes a request score its prompt (max_tokens may be 0 then), in each front end's words.
SCORED_BY = "echo on the OpenAI API, prompt_logprobs on gRPC"

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class InvalidField(ServingError):
    """INVALID_ARGUMENT naming ``field`` (as the client spells it): the front end maps it to its error."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    name: str | None = None  # the participant's name, handed to the chat template when set
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered with the model's chat template; the reply stops at its end of turn.
    ``tools`` the model may call, as ``tool_choice`` allows (unset: OpenAI's default) and at most one
    call per reply without ``parallel_tool_calls`` (``router/tool_calls.py``)."""

    messages: tuple[ChatTurn, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


def rendered_chars(prompt: ChatPrompt) -> tuple[int, int]:
    """The characters of every field the template or the tool format renders into the prompt -- the
    messages' contents, names, calls and call ids; the tools' names, descriptions and parameters -- as
    (in the messages, in the tools): what ``Admission.not_hopeless`` bounds before anything is tokenized
    (an outside probe's 3 MB tool description held every other call up for 3.7 s)."""
    chars = 0
    for m in prompt.messages:
        chars += len(m.content) + len(m.name or "") + len(m.tool_call_id or "")
        chars += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
    return chars, sum(len(t.name) + len(t.description) + len(t.parameters) for t in prompt.tools)


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: tuple[int, ...]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


@dataclass(frozen=True)
class FieldNames:
    """How a front end names a request's fields in its errors."""

    text: str  # a text prompt
    messages: str  # a conversation
    token_ids: str  # token ids, the whole list
    token_id: str  # one of them; "{i}" is its index
    sampling: str  # the prefix of a sampling field ("sampling." -> "sampling.top_p")
    structured: str = "sampling.structured"  # the field that carries the output's constraint
    n: str = "n"  # how many choices
    max_tokens: str = "max_tokens"  # after the prefix; OpenAI chat's max_completion_tokens where it set that
    tools: ToolFields = field(default_factory=ToolFields)  # the tool fields (OpenAI's by default)


@dataclass(frozen=True)
class GenerationRequest:
    """What a client asked for, front end aside: the one input of ``Admission.admit``."""

    request_id: str  # the client's: echoed back to it, never sent to a node
    prompt: Prompt
    fields: FieldNames
    # The SamplingParams fields the client set, by their names (a front end selects them by name, so a
    # new sampling field needs no line here); max_tokens absent: the default of the prompt's kind.
    sampling: Mapping[str, object] = field(default_factory=dict)
    cache_salt: str | None = None  # the client's; the caller's tenant is added at admission
    stream: bool = False
    include_usage: bool = True  # the OpenAI API's stream_options.include_usage; gRPC always has usage
    n: int = 1  # choices: the prompt is prefilled once, each choice samples on with its own seed
    adapter: str | None = None  # a LoRA adapter by name (None: the base model)
    adapter_field: str = "adapter"  # how the front end names it (OpenAI: "model")


@dataclass(frozen=True)
class AdmittedRequest:
    """What the pipeline runs: the prompt's token ids, complete sampling parameters, the tenant's salt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    n: int = 1  # choices (the pipeline forks them after one prefill: router/choices.py)
    tools: ToolParser | None = None  # how the reply's tool calls are read (None: the reply is text)
    adapter: AdapterId | None = None  # the LoRA adapter, as the nodes serve it (name and digest)
    streamed: bool = False  # the client reads the output as it comes (else whole, at the end)


class Admission:
    """Admits requests for ``model`` on a router whose ``max_tokens_limit`` (0: none) caps max_tokens."""

    def __init__(
        self,
        model: RouterModel,
        max_tokens_limit: int = 0,
        *,
        max_n: int = 16,
        adapters: RouterAdapters | None = None,
        node_context: Callable[[], int] | None = None,
    ) -> None:
        """``max_n``: the most choices (``n``) one request may ask for.  ``adapters``: the nodes' LoRA
        adapters (None: no adapter is served).  ``node_context``: the longest request every node serves
        (0: none said yet) -- a node whose KV cache holds less than the model's context serves less."""
        self.model = model
        self.node_context = node_context
        self.adapters = adapters
        self.max_tokens_limit = max_tokens_limit
        self.max_n = max_n
        # A constraint that does not compile is refused here, before any node call (engine/structured.py).
        self.grammars = model.grammars
        template = model.tokenizer.chat_template
        self.tool_format = tool_format(template.source if template is not None else None)

    @property
    def context_length(self) -> int:
        """The longest request admitted: the model's context (or --max-model-len), or less where the
        nodes serve less."""
        nodes = self.node_context() if self.node_context is not None else 0
        return min(self.model.context_length, nodes) if nodes else self.model.context_length

    def admit(self, request: GenerationRequest, caller: Caller) -> AdmittedRequest:
        """The request as the pipeline runs it; ``InvalidField`` when the client must change it."""
        unknown = set(request.sampling) - SAMPLING_FIELDS
        assert not unknown, f"a front end passed sampling fields SamplingParams lacks: {sorted(unknown)}"
        names = request.fields
        adapter = None if request.adapter is None else self._adapter(request.adapter, request.adapter_field)
        if not 1 <= request.n <= self.max_n:
            raise InvalidField(
                names.n, f"{request.n} choices asked; this server serves 1 to {self.max_n} (its max_n)"
            )
        plan, called = self._tool_plan(request.prompt, names)
        token_ids, prompt_field = self._tokens(request.prompt, names, plan, called)
        options = dict(request.sampling)
        chat = isinstance(request.prompt, ChatPrompt)
        if plan is not None and plan.calls_allowed:
            self._constrain(plan, options, names)
        scoring = options.get("prompt_logprobs") is not None
        options["max_tokens"] = self._max_tokens(
            options.get("max_tokens"), len(token_ids), prompt_field, chat, names, scoring
        )
        self._check_token_ids(options, names)
        min_tokens, max_tokens = options.get("min_tokens", 0), options["max_tokens"]
        if isinstance(min_tokens, int) and isinstance(max_tokens, int) and min_tokens > max_tokens:
            raise InvalidField(
                f"{names.sampling}min_tokens",
                f"{min_tokens} is more than {names.max_tokens} ({options['max_tokens']})",
            )
        try:
            params = SamplingParams(**options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise _sampling_error(str(exc), names) from None
        if params.structured is not None:
            try:
                self.grammars.compile(params.structured)
            except GrammarError as exc:
                raise InvalidField(names.structured, str(exc).removeprefix("structured.")) from None
        if chat:
            params = self.model.tokenizer.chat_sampling(params)
        parser = None
        if plan is not None and plan.calls_allowed:
            parser = ToolParser(plan.format, frozenset(plan.schemas), plan.parallel)
        salt = caller.salt(request.cache_salt)
        return AdmittedRequest(
            request.request_id,
            token_ids,
            params,
            salt,
            n=request.n,
            tools=parser,
            adapter=adapter,
            streamed=request.stream,
        )

    def _adapter(self, name: str, field_name: str) -> AdapterId:
        if self.adapters is None:
            raise ServingError(
                grpc.StatusCode.NOT_FOUND, f"{field_name}: {name!r}: this server serves no adapters"
            )
        return self.adapters.resolve(name, field_name)

    def chat_tokens(
        self, prompt: ChatPrompt, names: FieldNames, *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The conversation as the model reads it (``POST /tokenize`` counts it the way a request would)."""
        plan, called = self._tool_plan(prompt, names)
        return self._render(prompt, names, plan, called, add_generation_prompt)

    def _tool_plan(self, prompt: Prompt, names: FieldNames) -> tuple[ToolPlan | None, dict[int, str]]:
        """A conversation's tools, checked (None: no tools, or no template to show them), and each tool
        message of its history with the function it answers."""
        if not isinstance(prompt, ChatPrompt):
            return None, {}
        fields = names.tools
        # no schema compiled for tools that could never be shown (each compile holds the GIL)
        self.not_hopeless(rendered_chars(prompt)[1], fields.tools)
        try:
            called = check_history(prompt.messages, fields)
            schemas = check_tools(prompt.tools, fields, self._check_schema)
            choice = check_choice(prompt.tool_choice, list(schemas), fields)
        except ToolFieldError as exc:
            raise InvalidField(exc.field, exc.problem) from None
        if not schemas or self.tool_format is None:
            return None, called
        return ToolPlan(self.tool_format, prompt.tools, schemas, choice, prompt.parallel_tool_calls), called

    def _check_schema(self, schema: Mapping[str, object]) -> None:
        try:
            self.grammars.compile(StructuredOutput.json_schema(dict(schema)))
        except GrammarError as exc:
            raise ValueError(str(exc).removeprefix("structured.json_schema ")) from None

    def _constrain(self, plan: ToolPlan, options: dict[str, object], names: FieldNames) -> None:
        """A reply that may call tools is the model's or the tool grammar's: never another format too."""
        if options.get("structured") is not None:
            raise InvalidField(
                names.structured,
                f"cannot be combined with tools under tool_choice {plan.choice.mode!r}: a reply is a "
                "tool call or free text (send tool_choice 'none' to use the format with tools)",
            )
        forced = constraint(plan)
        if forced is None:
            return
        try:
            self.grammars.compile(forced)
        except GrammarError as exc:
            raise InvalidField(
                names.tools.tool_choice, f"the tools' call grammar does not compile: {exc}"
            ) from None
        options["structured"] = forced

    def _render(
        self,
        prompt: ChatPrompt,
        names: FieldNames,
        plan: ToolPlan | None,
        called: Mapping[int, str],
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The conversation's token ids (a request's, or /tokenize's count)."""
        in_messages, in_tools = rendered_chars(prompt)  # the field that holds more is named
        in_tools = in_tools if plan is not None and plan.calls_allowed else 0  # shown only then
        where = names.messages if in_messages >= in_tools else names.tools.tools
        self.not_hopeless(in_messages + in_tools, where)
        messages, tools = template_inputs(prompt.messages, self.tool_format, plan, called)
        # the tools' system message the generic format puts first: a message's error names the client's index
        added = len(messages) - len(prompt.messages)
        try:
            return self.model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except ChatTemplateError as exc:
            if exc.index is not None and exc.index >= added:  # a message's field, in the front end's spelling
                raise InvalidField(
                    f"{names.tools.message.format(i=exc.index - added)}.{exc.key}", exc.problem
                ) from None
            raise InvalidField(names.messages, str(exc)) from None

    def _tokens(
        self, prompt: Prompt, names: FieldNames, plan: ToolPlan | None, called: Mapping[int, str]
    ) -> tuple[list[int], str]:
        """The prompt's token ids, and the field that names the prompt in an error."""
        tokenizer = self.model.tokenizer
        if isinstance(prompt, TextPrompt):
            if not prompt.text:
                raise InvalidField(names.text, "is empty")
            self.not_hopeless(len(prompt.text), names.text)
            token_ids, where = tokenizer.encode(prompt.text), names.text
        elif isinstance(prompt, ChatPrompt):
            token_ids, where = self._render(prompt, names, plan, called), names.messages
        else:
            token_ids, where = list(prompt.token_ids), names.token_ids
            vocab = self.model.vocab_size
            for i, t in enumerate(token_ids):
                if not 0 <= t < vocab:
                    raise InvalidField(
                        names.token_id.format(i=i), f"token id {t} is outside the vocabulary [0, {vocab})"
                    )
        if not token_ids:
            raise InvalidField(where, "has no tokens: a prompt needs at least one")
        context = self.context_length
        if len(token_ids) > context:  # refused here, before any node call; == only scored (_max_tokens)
            raise InvalidField(where, f"has {len(token_ids)} tokens, more than max_model_len {context} holds")
        return token_ids, where

    def not_hopeless(self, chars: int, where: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit the context whatever its tokens: the
        tokenizer holds the GIL, and an outside probe's 4 MB prompt held up every other call for 1.9 s
        before its refusal.  Twice the bound, so no text that might fit is refused here."""
        most = self.model.tokenizer.max_token_chars
        if chars > 2 * self.context_length * most:
            raise InvalidField(
                where,
                f"has {chars} characters: more than max_model_len {self.context_length} tokens can hold "
                f"(a token of this model stands for {most} characters at most)",
            )

    def _max_tokens(
        self,
        asked: object,
        prompt_len: int,
        prompt_field: str,
        chat: bool,
        names: FieldNames,
        scoring: bool = False,
    ) -> int:
        """The client's max_tokens, checked; or the default of the prompt's kind, cut to what fits.  0
        only when the request scores its prompt (``scoring``: prompt_logprobs, OpenAI's echo)."""
        name = f"{names.sampling}{names.max_tokens}"
        context = self.context_length
        room = context - prompt_len
        limit = self.max_tokens_limit
        if isinstance(asked, int) and not isinstance(asked, bool) and asked == 0 and scoring:
            return 0  # the prompt scored, nothing generated: it may fill the context
        if room < 1:
            raise InvalidField(
                prompt_field,
                f"has {prompt_len} tokens, as many as max_model_len {context} holds: no room for an output "
                f"token (a prompt that long can only be scored: {name} 0 with {SCORED_BY})",
            )
        if asked is None:
            default = MAX_DEFAULT_CHAT_TOKENS if chat else DEFAULT_MAX_TOKENS
            return min(default, room, limit or default)
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            raise InvalidField(
                name,
                f"must be a positive integer (0 only when the prompt is scored: {SCORED_BY}), got {asked!r}",
            )
        if limit and asked > limit:
            raise InvalidField(
                name,
                f"{asked} is more than this server allows ({limit}): the router's max_tokens_limit {limit}",
            )
        if asked > room:
            raise InvalidField(
                name,
                f"{asked} does not fit: {prompt_field} has {prompt_len} tokens and the model's context "
                f"(max_model_len) holds {context}; ask for at most {room}",
            )
        return asked

    def _check_token_ids(self, options: Mapping[str, object], names: FieldNames) -> None:
        """A stop token or a biased token outside the vocabulary could never act: refused, not accepted
        and ignored."""
        vocab = self.model.vocab_size
        stop_token_ids = options.get("stop_token_ids", ())
        for i, t in enumerate(stop_token_ids if isinstance(stop_token_ids, list | tuple) else ()):
            if isinstance(t, int) and not 0 <= t < vocab:
                raise InvalidField(
                    f"{names.sampling}stop_token_ids[{i}]", f"{t} is outside the vocabulary [0, {vocab})"
                )
        bias = options.get("logit_bias", {})
        for t in bias if isinstance(bias, Mapping) else ():
            if isinstance(t, int) and not 0 <= t < vocab:
                raise InvalidField(
                    f"{names.sampling}logit_bias", f"token id {t} is outside the vocabulary [0, {vocab})"
                )


def _sampling_error(message: str, names: FieldNames) -> InvalidField:
    """``SamplingParams``'s ValueError, naming the field it is about (its message names it)."""
    name = next((w for w in re.findall(r"\w+", message) if w in SAMPLING_FIELDS), None)
    if name is None:
        return InvalidField(names.sampling.rstrip(".") or "body", message)
    problem = message[len(name) :].lstrip() if message.startswith(name + " ") else message
    return InvalidField(f"{names.sampling}{name}", problem)
