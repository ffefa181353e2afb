"""Write the chat prompts an EAGLE-3 head is trained and tested on: short explanatory requests
from templates and topic lists of our own, split so that held-out prompts share no topic with the
training ones. Deterministic.

    python client_examples/eagle3/make_prompts.py --out DIR [--train 256 --heldout 24]

DIR/train.jsonl and DIR/heldout.jsonl: {"id", "messages"} per line (`hsserve extract`'s input).
"""

from __future__ import annotations

import argparse
import json
import os
import random

TEMPLATES = [
    "Write a short paragraph about {t}.",
    "Explain {t} to a ten-year-old in a few sentences.",
    "List three interesting facts about {t}.",
    "Describe {t} in simple words.",
    "Why is {t} important? Answer briefly.",
    "Give a short introduction to {t}.",
]
SUBJECTS = [
    "the moon", "volcanoes", "honey bees", "the ocean", "rainbows", "dinosaurs", "the sun",
    "trees", "clouds", "elephants", "the human heart", "electricity", "gravity", "the internet",
    "bicycles", "chess", "music", "coffee", "bread", "the rain forest", "penguins", "mountains",
    "rivers", "the desert", "earthquakes", "the weather", "whales", "the brain", "sleep",
    "recycling", "solar power", "wind energy", "the library", "airplanes", "trains", "bridges",
    "castles", "pyramids", "the olympic games", "football", "tennis", "swimming", "painting",
    "photography", "the camera", "the telephone", "computers", "robots", "the printing press",
    "money", "banks", "farming", "rice", "potatoes", "apples", "oranges", "chocolate", "tea",
    "cheese", "milk", "the immune system", "vaccines", "bacteria", "the microscope", "stars",
    "planets", "mars", "jupiter", "comets", "the milky way", "black holes", "the seasons",
    "snow", "ice", "glaciers", "lakes", "islands", "coral reefs", "sharks", "dolphins", "owls",
    "eagles", "butterflies", "ants", "spiders", "frogs", "snakes", "horses", "dogs", "cats",
    "the piano", "the guitar", "poetry", "novels", "theatre", "cinema", "newspapers", "maps",
    "compasses", "clocks", "calendars", "the wheel", "fire", "glass", "paper", "plastic",
    "steel", "gold", "diamonds", "salt", "water", "air", "oxygen", "plants", "flowers", "seeds",
    "gardens", "parks", "cities", "villages", "roads", "cars", "electric cars", "rockets",
    "satellites", "the space station", "astronauts", "the telescope", "light", "sound",
    "magnets", "batteries", "the kitchen", "cooking", "soup", "pizza", "pasta", "vegetables",
    "exercise", "friendship", "school", "teachers", "languages", "writing", "mathematics",
]


def prompts(topics: list[str], n: int, rng: random.Random, tag: str) -> list[dict]:
    out = []
    for i in range(n):
        text = rng.choice(TEMPLATES).format(t=topics[i % len(topics)])
        out.append({"id": f"{tag}{i}", "messages": [{"role": "user", "content": text}]})
    return out


def write(folder: str, train: int = 128, heldout: int = 24, seed: int = 0) -> tuple[str, str]:
    rng = random.Random(seed)
    topics = sorted(set(SUBJECTS))
    rng.shuffle(topics)
    held, rest = topics[:heldout], topics[heldout:]
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, rows in (("train", prompts(rest, train, rng, "t")),
                       ("heldout", prompts(held, heldout, rng, "h"))):
        paths.append(os.path.join(folder, f"{name}.jsonl"))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths[0], paths[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--heldout", type=int, default=24)
    a = p.parse_args()
    print(*write(a.out, a.train, a.heldout))


if __name__ == "__main__":
    main()
