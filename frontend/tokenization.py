"""Tokenization and chat templating, off the event loop.

Encoding a 100k-character prompt takes long enough to stall every open stream, so it
runs in a worker thread. One worker: a Hugging Face fast tokenizer is not safe to call
from several threads at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2

from frontend.chat_render import Conversation, render_conversation
from frontend.errors import invalid_param
from frontend.schemas import ChatMessage
from frontend.token_texts import TokenTexts
from frontend.tools import ToolRequest


class TokenizerService:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self._encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self._decode, token_ids)

    async def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          tools: ToolRequest | None = None) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise invalid_param("messages", "this model has no chat template (a base model): "
                                "use /v1/completions, or start the server with "
                                "--chat-template FILE")
        conversation, template_tools = render_conversation(messages, tools, template)
        return await self._run(self._render_and_encode, conversation, add_generation_prompt,
                               template_tools)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _render_and_encode(self, conversation: Conversation, add_generation_prompt: bool,
                           tools: list[dict] | None = None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt
            )
        except (jinja2.TemplateError, ValueError) as exc:
            raise invalid_param(
                "messages", f"The chat template rejected the messages: {exc}"
            ) from exc
        # The rendered template already holds the special tokens (BOS included).
        return self._encode(text, add_special_tokens=False)
