"""What the Messages and Responses e2e modules share: their one keyed server's key, the
model, and the conversations and tool they both put to it."""

from __future__ import annotations

API_KEY = "sk-loom-agent-apis"
MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
QUESTION = "Name three colours of the rainbow."
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER = {  # the get_weather tool's parameters
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
