"""The committed generated code must be exactly what scripts/gen_protos.py produces from protos/."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_matches_protos(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    committed = ROOT / "sdk" / "fedclinic" / "proto"
    names = sorted(p.name for p in written)
    assert names == sorted(p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi"))
    for p in written:
        assert p.read_text() == (committed / p.name).read_text(), (
            f"{p.name} is stale: run `make protos` (python scripts/gen_protos.py) and commit the result")


def test_services_and_fields_exist():
    from fedclinic.proto import agent_pb2, control_pb2, tensors_pb2

    agent = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
    assert {m.name for m in agent.methods} >= {"Hello", "WatchWork", "FetchModel", "SubmitUpdate"}
    control = control_pb2.DESCRIPTOR.services_by_name["Control"]
    assert {m.name for m in control.methods} >= {"SubmitTask", "GetTask", "ListTasks", "WatchTask", "CancelTask",
                                                "FetchModel"}
    header = tensors_pb2.TensorHeader.DESCRIPTOR.fields_by_name
    assert {"dtype", "shape", "codec", "sha256"} <= set(header)
