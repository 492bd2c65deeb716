"""A fake model whose every answer is a scripted text: for the faces' tests over the fake
engine (``tests.fakes.fake_async_engine(script=replies.script(), tokenizer=TOKENIZER)``)."""

from collections.abc import Callable

from adapters.fake import ByteTokenizer
from domain.request import Request

TOKENIZER = ByteTokenizer()


class Replies:
    """A fake model that answers ``text`` to every request (then EOS) and keeps what it was
    asked."""

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.requests: list[Request] = []

    def script(self) -> Callable[[Request], int]:
        def next_token(request: Request) -> int:
            if not request.generated_token_ids:
                self.requests.append(request)
            tokens = [*TOKENIZER.encode(self.text, add_special_tokens=False), 2]
            return tokens[min(len(request.generated_token_ids), len(tokens) - 1)]

        return next_token

    def prompt(self) -> str:
        return TOKENIZER.decode(self.requests[-1].prompt_token_ids)
