"""What the composition root takes from the model's tokenizer: the tool-call format its
chat template writes."""

from application.serving.tool_parsers import detect_format


def choose_tool_parser(flag: str | None, chat_template: str | None) -> str:
    """``--tool-call-parser``: a format's name, or ``auto``: the one the chat template's
    model family writes (ChatML and templates without tools: ``hermes``)."""
    if flag and flag != "auto":
        return flag
    return detect_format(chat_template)
