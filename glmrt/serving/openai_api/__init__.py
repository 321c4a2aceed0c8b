"""The OpenAI-compatible surface, as pure functions, one module per concern:

    errors         APIError and the error answers (OpenAI's JSON shape)
    fields         typed readers for request-body fields
    chat_messages  validation of messages, tools, tool_choice, template options
    requests       chat / completions parsing, SamplingParams, the TokenizeRequests to send
    structured     response_format, regex, ebnf (and vLLM's spellings) into one Grammar
    responses      usage, logprobs, the choice accumulator, non-streamed bodies, model list
    streaming      streamed chunks and SSE framing

No aiohttp and no torch here: the api actor calls these, and the tests check what they build
against the official `openai` client's types.

Conventions (documented choices):
- Unknown fields are ignored (OpenAI clients send extras through `extra_body`); the glmrt /
  vLLM / SGLang extras we honour are top_k, min_p, repetition_penalty, min_tokens,
  ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens,
  return_token_ids, chat_template_kwargs, max_thinking_tokens, regex and ebnf. Known OpenAI
  fields whose semantics we cannot honour yet (an allowed-tools tool_choice, logit_bias, echo,
  suffix, best_of != n, functions) answer 400 instead of being silently dropped. A null field means "absent".
- `max_tokens`: `max_completion_tokens` wins over `max_tokens`. When neither is set, chat
  asks for `max_model_len` tokens (`to_sampling_params(max_model_len=...)`; the engine ends
  the request with finish_reason "length" when the context is full) and completions use
  OpenAI's default of 16. An explicit value whose prompt + max_tokens exceeds the context is
  a 400 (context_length_exceeded), as vLLM answers it, decided by the tokenizer actor.
- Completions `logprobs: k` means token logprobs plus the top k (0..20); chat uses
  `logprobs: bool` + `top_logprobs: 0..20`.
- A list of completion prompts becomes one engine request per prompt (`RequestKey.prompt`);
  choice `i` of prompt `p` is reported as index `p * n + i`.
- `return_token_ids`: chat puts `prompt_token_ids` at the top level of the response (and of
  the first streamed chunk); completions put it on each choice (each choice may have its own
  prompt), as vLLM does. `token_ids` goes on every choice and every streamed choice delta.
- `parallel_tool_calls: false` keeps only the first call of a choice (dropped here, in the
  api, so the tokenizer and detokenizer need not know).
"""

from glmrt.serving.openai_api.errors import (APIError, bad_request, context_length_exceeded, error_from_wire,
                                             internal_error, not_found_model, not_supported, overloaded, too_large,
                                             unauthorized)
from glmrt.serving.openai_api.requests import (MAX_STOP_SEQUENCES, ChatRequest,
                                               CompletionRequest, engine_request_count, parse_chat_request,
                                               parse_completion_request, to_sampling_params, to_tokenize_request,
                                               to_tokenize_requests)
from glmrt.serving.openai_api.responses import (LOGPROB_FLOOR, ChoiceAccumulator, TextOffsets, UsageTotals,
                                                chat_completion_response, completion_logprobs, completion_response,
                                                models_response, new_request_id, response_index, usage_json)
from glmrt.serving.openai_api.streaming import (SSE_DONE, ChatStream, CompletionStream, chat_chunk, completion_chunk,
                                                sse, sse_error, usage_chunk)

__all__ = [
    "APIError", "bad_request", "not_supported", "not_found_model", "unauthorized", "too_large", "overloaded",
    "context_length_exceeded", "internal_error", "error_from_wire",
    "ChatRequest", "CompletionRequest", "parse_chat_request", "parse_completion_request",
    "to_sampling_params", "to_tokenize_request", "to_tokenize_requests", "engine_request_count",
    "new_request_id", "response_index", "usage_json", "UsageTotals", "ChoiceAccumulator", "TextOffsets",
    "completion_logprobs",
    "chat_completion_response", "completion_response", "ChatStream", "CompletionStream",
    "chat_chunk", "completion_chunk", "usage_chunk", "sse", "sse_error", "SSE_DONE", "models_response",
    "MAX_STOP_SEQUENCES", "LOGPROB_FLOOR",
]
