"""Exploration: extract the target's states at several aux layer sets, train one draft on the manifest's set
([2,4,5]) and evaluate it (speculators' val metrics) on the val split of each set and with its fc zeroed.
    python explore.py TARGET WORK [--sets 2,4,5;3,5,6;1,3,4] [--steps 40] [--convs 300]"""
import argparse, json, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import yaml
ap = argparse.ArgumentParser()
ap.add_argument("target"); ap.add_argument("work")
ap.add_argument("--sets", default="2,4,5;3,5,6;1,3,4")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--convs", type=int, default=300)
ap.add_argument("--final", type=int, default=8)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--epochs", type=int, default=3)
a = ap.parse_args()
from eagle_states.config import PipelineParams
from eagle_states.demo import write_demo_conversations
from eagle_states.export import export_dataset
BIN = Path(sys.executable).parent
target, work = Path(a.target), Path(a.work); work.mkdir(parents=True, exist_ok=True)
recipe = json.loads((target / "target_training.json").read_text()).get("recipe", "chat")
convs = work / "conversations.jsonl"
if not convs.exists():
    write_demo_conversations(convs, count=a.convs, seed=0, recipe=recipe)
sets = [s for s in a.sets.split(";")]
exports = {}
for s in sets:
    d = work / ("ds-" + s.replace(",", "-"))
    exp = d / "export"
    if not exp.exists():
        params = PipelineParams.model_validate({
            "model": {"path": str(target), "build_demo_if_missing": False},
            "data": {"path": str(convs)},
            "prepare": {"out": str(work / "prepared"), "max_length": 1024},
            "extract": {"dtype": "float32", "max_model_len": 1280, "max_num_batched_tokens": 4096,
                        "shard_max_tokens": 16384, "layer_ids": f"{s},{a.final}"},
            "validate": {"report": str(d / "validation.json")},
            "output": {"dir": str(d / "dataset"), "prefect_results": str(d / ".prefect-results")}})
        d.mkdir(parents=True, exist_ok=True)
        (d / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json", by_alias=True)))
        for step in ("prepare", "extract", "validate"):
            done = subprocess.run([str(BIN / "eagle-states"), step, "--params", str(d / "params.yaml"), *(["--no-progress"] if step != "validate" else [])],
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
        export_dataset(d / "dataset", exp, "speculators", progress=False)
    exports[s] = exp
import torch
from eagle_states.acceptance import draft as D
results = {}
orig_eval = D._evaluate
def evaluate(model, val, call):
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader
    from speculators.models.eagle3.data import shift_batch
    out = {"trained": orig_eval(model, val, call)}
    for s, exp in exports.items():
        data = ArrowDataset(max_len=2048, datapath=str(exp.resolve()), on_missing="raise", train_ratio=0.9, split="val",
                            hidden_states_dtype=torch.float32)
        v = _setup_dataloader(data, 2048, model.hidden_size, num_workers=0, num_target_layers=3, prefetch_factor=None,
                              preprocess=shift_batch, seed=0)
        out["served " + s] = orig_eval(model, v, call)
    w = model.fc.weight.data.clone(); b = None if model.fc.bias is None else model.fc.bias.data.clone()
    model.fc.weight.data.zero_()
    if b is not None: model.fc.bias.data.zero_()
    out["fc zeroed"] = orig_eval(model, val, call)
    model.fc.weight.data.copy_(w)
    results.update(out)
    return out["trained"]
D._evaluate = evaluate
t0 = time.time()
rec = D.train_draft(exports[sets[0]], target, work / f"draft-{a.steps}", D.DraftRecipe(epochs=a.epochs, max_steps=a.steps, lr=a.lr), "none")
print("draft", rec["steps"], "steps", rec["final_loss"], round(time.time() - t0), "s")
for k, v in results.items():
    print(f"{k:<16}", " ".join(f"{v[x]:.3f}" for x in ("full_acc_0", "full_acc_1", "full_acc_2")), f"loss {v['loss']:.3f}")
(work / f"explore-{a.steps}.json").write_text(json.dumps(results, indent=1))
