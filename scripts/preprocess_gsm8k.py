"""Turn a GSM8K-format file into training rows, in the style of verl's examples/data_preprocess/gsm8k.py.

    python3 scripts/preprocess_gsm8k.py IN OUT [--agent-name NAME] [--instruction TEXT]

IN is any file rlsys reads (JSONL, JSON, Parquet, Arrow, a save_to_disk directory) with GSM8K's fields: `question`,
and `answer`, a solution ending in `#### 42`. OUT (.jsonl or .parquet) gets one row per problem, with the
fields both rlsys's defaults and verl's layout read:

    {"prompt": [{"role": "user", "content": question + " " + instruction}], "answer": "42",
     "reward_model": {"style": "rule", "ground_truth": "42"}, "data_source": "gsm8k", "ability": "math",
     "extra_info": {"index": i, "question": ..., "solution": ...}, "agent_name": NAME (with --agent-name)}

Train with dataset.path=OUT (dataset.answer_key=reward_model.ground_truth reads verl's field instead).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rlsys.data.dataset import DatasetError, RowFormat, load_rows  # noqa: E402
from rlsys.impl.env.math_answers import GSM8K_FINAL, reference_answer  # noqa: E402

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def training_rows(rows: list[dict], source: Path, instruction: str, agent_name: str) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        if not GSM8K_FINAL.search(row["answer"]):
            raise DatasetError(f"{source}: row {index + 1}: field 'answer' has no '#### <answer>' line "
                               f"(GSM8K's solutions end in one)")
        final = reference_answer(row["answer"])
        question = row["prompt"]
        out.append({"prompt": [{"role": "user", "content": f"{question} {instruction}".strip()}], "answer": final,
                    "reward_model": {"style": "rule", "ground_truth": final}, "data_source": "gsm8k",
                    "ability": "math", "extra_info": {"index": index, "question": question, "solution": row["answer"]},
                    **({"agent_name": agent_name} if agent_name else {})})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="GSM8K-format file or directory (question, answer)")
    parser.add_argument("output", help="rows to write: .jsonl or .parquet")
    parser.add_argument("--agent-name", default="", help="agent_name to give every row (as verl's tool-agent rows)")
    parser.add_argument("--instruction", default=INSTRUCTION, help="text put after each question")
    args = parser.parse_args(argv)
    source, output = Path(args.input), Path(args.output)
    if output.suffix not in (".jsonl", ".parquet"):
        print(f"error: {output} must end in .jsonl or .parquet", file=sys.stderr)
        return 2
    try:
        rows = training_rows(load_rows(source, RowFormat(prompt_key="question", settings="")), source, args.instruction,
                             args.agent_name)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import datasets

    output.parent.mkdir(parents=True, exist_ok=True)
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(output)) if output.suffix == ".parquet" else table.to_json(str(output), lines=True)
    print(f"wrote {len(rows)} rows to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
