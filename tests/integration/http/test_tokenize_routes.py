"""vLLM's /tokenize and /detokenize, and /v1/models' fields (fake runner, byte tokenizer)."""

from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from tests.fakes import fake_container


def client(tmp_path) -> TestClient:
    container = fake_container(cache_dir=str(tmp_path), served_model_name="m")
    return TestClient(app=container.http_app())  # type: ignore[arg-type]


def test_tokenize_and_detokenize_round_trip(tmp_path) -> None:
    tokenizer = ByteTokenizer()
    with client(tmp_path) as http:
        reply = http.post("/tokenize", json={"model": "m", "prompt": "héllo"})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["tokens"] == tokenizer.encode("héllo")
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
        assert body["token_strs"] is None
        bare = http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
        assert bare.json()["tokens"] == tokenizer.encode("hi", add_special_tokens=False)
        strs = http.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
        assert "".join(strs["token_strs"]).endswith("ab")
        back = http.post("/detokenize", json={"tokens": bare.json()["tokens"]})
        assert back.json() == {"prompt": "hi"}


def test_tokenize_a_chat_as_a_completion_would_render_it(tmp_path) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with client(tmp_path) as http:
        body = http.post("/tokenize", json={"messages": messages}).json()
    assert body["tokens"] == ByteTokenizer().render_chat(messages)


def test_bad_requests_are_openai_errors(tmp_path) -> None:
    with client(tmp_path) as http:
        both = http.post("/tokenize", json={"prompt": "a", "messages": []})
        assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
        assert http.post("/tokenize", json={}).status_code == 400
        assert http.post("/tokenize", json={"model": "x", "prompt": "a"}).status_code == 404
        out = http.post("/detokenize", json={"tokens": [10**9]})
        assert out.status_code == 400 and out.json()["error"]["param"] == "tokens"
        assert http.post("/detokenize", json={"tokens": "abc"}).status_code == 400
        assert http.post("/tokenize", json={"prompt": "a", "color": 1}).status_code == 400


def test_models_list_their_root_and_context(tmp_path) -> None:
    with client(tmp_path) as http:
        [card] = http.get("/v1/models").json()["data"]
    # root: the weights served under the name "m" (the fake runner's model spec)
    assert (card["id"], card["root"], card["parent"], card["object"]) == (
        "m",
        "fake",
        None,
        "model",
    )
    assert card["max_model_len"] > 0 and card["owned_by"] == "infer"
