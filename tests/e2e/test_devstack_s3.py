"""`python -m devstack up --tiny --s3`: tiny-s3's weights are in a local S3 server that refuses
anyone without the key (moto, IAM enforced); the key is only in the model's Nomad Variable, the
job's fetch task brings the weights into the node's cache with it, and the model answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import openai
import pytest

from devstack import s3_weights
from nomad_driver.spec import load_models
from nomad_driver.variables import source_variable_path
from tests.e2e.conftest import DevStack, start_devstack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    stack = start_devstack(tmp_path_factory.mktemp("devstack-s3"), "--s3")
    try:
        yield stack
    finally:
        stack.down()


def test_the_model_from_s3_answers_a_chat_request(stack: DevStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.router}/v1", api_key="e2e", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=s3_weights.MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.choices


def test_the_weights_came_from_s3_with_the_key_in_the_models_variable(stack: DevStack) -> None:
    source = load_models(Path(stack.info["models_file"])).models[s3_weights.MODEL].source
    endpoint = parse_qs(urlsplit(source).query)["endpoint"][0]
    # The server enforces credentials: without the key, nothing.
    anonymous = httpx.get(f"{endpoint}/{s3_weights.BUCKET}/{s3_weights.KEY}", timeout=10)
    assert anonymous.status_code == 403, anonymous.text
    variable = httpx.get(f"{stack.nomad}/v1/var/{source_variable_path(s3_weights.MODEL)}", timeout=10).json()
    assert set(variable["Items"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # The fetch filled the cache of the node the replica runs on, and the engine read it there.
    cached = list((Path(stack.info["state_dir"]) / "weights").glob(f"*/{s3_weights.MODEL}/tiny.gguf"))
    assert len(cached) == 1
    assert cached[0].read_bytes() == (Path(stack.info["state_dir"]) / "models" / "tiny-s3.gguf").read_bytes()
