"""A model whose chat template has a tool format of its own gets that format: admission
stores it with the run and its template shows the model the tools and earlier calls.

The Hermes-style template is Qwen2.5-7B-Instruct's, from the model's tokenizer_config.json
on Hugging Face (tests/fixtures/chat_templates/)."""

import json
import shutil
from pathlib import Path

import pytest

from services.admission.cancel import Canceller
from services.admission.catalog import ModelCatalog
from services.admission.gateway import Gateway, GatewayConfig
from services.admission.grpc.messages import params_from_proto
from services.admission.requests import GenerateParams, Limits
from services.admission.stream import RunFeed
from services.core.errors import InvalidArgument
from services.core.runs import StoredEvent
from tests.services.admission.calls import count_runs
from tests.services.admission.running import MODEL, Admission
from tollgate.v1 import events_pb2

QWEN_TEMPLATE = Path(__file__).parents[2] / "fixtures/chat_templates/Qwen-Qwen2.5-7B-Instruct.jinja"
WEATHER = events_pb2.FunctionTool(
    name="get_weather",
    description="The weather in a city",
    parameters=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)
CONVERSATION = [
    events_pb2.ChatMessage(role="user", content="Weather in Oslo?"),
    events_pb2.ChatMessage(
        role="assistant",
        tool_calls=[
            events_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
        ],
    ),
    events_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    events_pb2.ChatMessage(role="user", content="And in Bergen?"),
]


@pytest.fixture(scope="module")
def hermes_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Qwen2.5's chat template."""
    model_dir = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN_TEMPLATE.read_text()
    config_path.write_text(json.dumps(config))
    return model_dir


def gateway_on(admission: Admission, model_dir: Path) -> Gateway:
    return Gateway(
        admission.db,
        ModelCatalog.load({MODEL: str(model_dir)}),
        RunFeed(admission.store.db.url.render_as_string(hide_password=False)),
        Canceller(admission.store, None),
        GatewayConfig(limits=Limits()),
    )


def params(key: str, tool_format: str = "", tools: bool = True) -> GenerateParams:
    sampling = events_pb2.SamplingParams(max_tokens=8, tool_format=tool_format)
    if tools:
        sampling.tools.append(WEATHER)
    message = events_pb2.GenerateRequest(
        model=MODEL, messages=CONVERSATION, sampling=sampling, idempotency_key=key
    )
    return params_from_proto(message, Limits())


async def started(gateway: Gateway, tenant_id: str, asked: GenerateParams) -> StoredEvent:
    [queued] = (await gateway.start(tenant_id, asked)).stored
    return queued


def prompt_of(gateway: Gateway, queued: StoredEvent) -> str:
    tokenizer = gateway.catalog.get(MODEL).tokenizer
    return tokenizer.decode(queued.payload["prompt_token_ids"], skip_special_tokens=False)


async def test_a_hermes_template_gets_its_format_stored_and_shows_the_tools(
    admission: Admission, hermes_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("acme")
    gateway = gateway_on(admission, hermes_model_dir)
    assert gateway.catalog.get(MODEL).tool_format == "hermes"
    queued = await started(gateway, tenant_id, params("k1"))
    assert queued.payload["sampling"]["tool_format"] == "hermes"
    prompt = prompt_of(gateway, queued)
    # The template's own tool prompt, not the generic one.
    assert "<tools>\n" in prompt and '"name": "get_weather"' in prompt
    assert "You can call these tools" not in prompt
    # The earlier call and its answer, as the template writes them.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in (
        prompt
    )
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    # A retry under the same key asks the same, so it finds the same run.
    again = await gateway.start(tenant_id, params("k1"))
    assert again.run_id == queued.run_id and again.stored == ()


async def test_without_tools_nothing_is_chosen_and_generic_is_not_stored(
    admission: Admission, hermes_model_dir: Path, tiny_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("acme")
    hermes = gateway_on(admission, hermes_model_dir)
    plain = await started(hermes, tenant_id, params("k1", tools=False))
    assert "tool_format" not in plain.payload["sampling"]
    chosen = await started(hermes, tenant_id, params("k2", tool_format="generic"))
    assert "tool_format" not in chosen.payload["sampling"]
    assert "You can call these tools" in prompt_of(hermes, chosen)
    # A template without a format of its own gets the generic one.
    generic = gateway_on(admission, tiny_model_dir)
    assert generic.catalog.get(MODEL).tool_format == "generic"
    queued = await started(generic, tenant_id, params("k3"))
    assert "tool_format" not in queued.payload["sampling"]
    assert "You can call these tools" in prompt_of(generic, queued)


@pytest.mark.parametrize(("template", "asked"), [("hermes", "llama3"), ("tiny", "hermes")])
async def test_a_format_the_template_does_not_know_is_refused_by_name(
    admission: Admission, hermes_model_dir: Path, tiny_model_dir: Path, template: str, asked: str
) -> None:
    tenant_id, _ = await admission.new_tenant_key("acme")
    model_dir = hermes_model_dir if template == "hermes" else tiny_model_dir
    with pytest.raises(InvalidArgument) as caught:
        await gateway_on(admission, model_dir).start(tenant_id, params("k1", tool_format=asked))
    assert [v.field for v in caught.value.violations] == ["sampling.tool_format"]
    assert await count_runs(admission) == 0
