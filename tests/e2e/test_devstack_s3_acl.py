"""`python -m devstack up --tiny --s3 --acl`: with Nomad's ACLs on, tiny-s3's fetch reads its keys
through its job's workload identity, which the policy the stack attaches to both of the model's
job IDs allows (docs/models.md); without it the template would fail with Nomad's 403."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from devstack import s3_weights
from tests.e2e.conftest import DevStack, start_devstack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    stack = start_devstack(tmp_path_factory.mktemp("devstack-s3-acl"), "--s3", "--acl")
    try:
        yield stack
    finally:
        stack.down()


def test_the_model_from_s3_answers_with_acls_on(stack: DevStack) -> None:
    # With ACLs on the router asks for the key the stack put in its Variable.
    key = stack.env["OPENAI_API_KEY"]
    client = openai.OpenAI(base_url=f"{stack.router}/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=s3_weights.MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.choices
