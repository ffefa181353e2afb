"""Build the probe's labelled dataset: short sentences on four topics (sports, cooking,
technology, weather), from templates and word lists of our own; written to topics.tsv
(label<TAB>sentence). Deterministic: the committed file is what this script writes.

    python client_examples/probe/make_dataset.py [--per-label 100]
"""

from __future__ import annotations

import argparse
import os
import random

TOPICS = {
    "sports": {
        "templates": [
            "The {team} won the {event} after a tense {period}.",
            "Our {player} scored twice in the {event} last night.",
            "Fans cheered as the {team} took the lead in the {period}.",
            "The coach said the {team} needs more {skill} before the {event}.",
            "She trained every morning to improve her {skill} for the {event}.",
            "The referee stopped the {event} when the {player} got injured.",
            "Tickets for the {event} sold out in minutes.",
            "After the {period}, the {team} changed their {player}.",
            "He broke the record in the {event} with amazing {skill}.",
            "The {team} lost the {event} but their {player} played well.",
        ],
        "slots": {
            "team": ["home team", "visitors", "national side", "local club", "underdogs", "champions"],
            "event": ["final", "semi-final", "derby", "marathon", "tournament", "league match", "relay"],
            "period": ["second half", "overtime", "first quarter", "penalty shootout", "last lap"],
            "player": ["striker", "goalkeeper", "captain", "sprinter", "point guard", "rookie"],
            "skill": ["speed", "stamina", "passing", "defence", "footwork", "shooting"],
        },
    },
    "cooking": {
        "templates": [
            "Stir the {ingredient} into the {dish} and let it {verb} for ten minutes.",
            "My grandmother's {dish} always had a pinch of {spice}.",
            "Chop the {ingredient} finely before you {verb} it.",
            "This {dish} tastes better with fresh {ingredient} and {spice}.",
            "Preheat the oven, then {verb} the {ingredient} until golden.",
            "For the {dish}, you need two cups of {ingredient}.",
            "He added too much {spice} to the {dish}.",
            "Let the {dish} rest before serving it with {ingredient}.",
            "The recipe says to {verb} the {ingredient} with a little {spice}.",
            "We tasted a {dish} seasoned with {spice} at the market.",
        ],
        "slots": {
            "ingredient": ["onions", "garlic", "butter", "flour", "tomatoes", "rice", "mushrooms", "lentils"],
            "dish": ["soup", "stew", "risotto", "curry", "pie", "sauce", "bread", "omelette"],
            "spice": ["cumin", "paprika", "thyme", "black pepper", "cinnamon", "oregano", "salt"],
            "verb": ["simmer", "roast", "bake", "saute", "fry", "boil", "grill"],
        },
    },
    "technology": {
        "templates": [
            "The new {device} ships with a faster {part}.",
            "Engineers released a {software} update that fixes the {problem}.",
            "Our {software} crashed because of a {problem} in the {part}.",
            "She installed the {software} on her {device} last week.",
            "The {device} overheats when the {part} runs at full speed.",
            "Developers are rewriting the {software} to avoid the {problem}.",
            "A {problem} was found in the {device}'s {part}.",
            "The company announced a cheaper {device} with more {part} capacity.",
            "Restart the {device} after the {software} finishes installing.",
            "The {part} in this {device} was designed for machine learning.",
        ],
        "slots": {
            "device": ["laptop", "phone", "server", "tablet", "router", "smartwatch", "graphics card"],
            "part": ["processor", "memory", "battery", "storage", "network chip", "display driver"],
            "software": ["operating system", "browser", "database", "compiler", "app", "firmware"],
            "problem": ["security flaw", "memory leak", "race condition", "driver bug", "crash"],
        },
    },
    "weather": {
        "templates": [
            "Expect {condition} across the {region} this {time}.",
            "The forecast warns of {condition} and strong {wind} winds.",
            "Temperatures will drop to {temp} degrees by {time}.",
            "After days of {condition}, the {region} finally saw sunshine.",
            "A {wind} breeze will bring {condition} to the {region}.",
            "Farmers in the {region} are worried about the {condition}.",
            "It will be {temp} degrees with {condition} on {time}.",
            "Meteorologists expect {condition} to clear by {time}.",
            "The {region} recorded its coldest {time} in years.",
            "Carry an umbrella: {condition} is likely this {time}.",
        ],
        "slots": {
            "condition": ["heavy rain", "snow", "thick fog", "thunderstorms", "hail", "drizzle", "frost"],
            "region": ["north", "coast", "valley", "mountains", "capital", "islands", "plains"],
            "time": ["weekend", "morning", "evening", "Tuesday", "afternoon", "night"],
            "wind": ["northern", "westerly", "gusty", "icy", "warm"],
            "temp": ["minus five", "two", "ten", "fourteen", "thirty"],
        },
    },
}


def sentences(topic: dict, count: int, rng: random.Random) -> list[str]:
    out: set[str] = set()
    while len(out) < count:
        template = rng.choice(topic["templates"])
        fill = {k: rng.choice(v) for k, v in topic["slots"].items()}
        out.add(template.format(**fill))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-label", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "topics.tsv"))
    args = ap.parse_args()
    rng = random.Random(0)
    rows = [(label, s) for label, topic in TOPICS.items() for s in sentences(topic, args.per_label, rng)]
    rng.shuffle(rows)
    with open(args.out, "w") as f:
        f.writelines(f"{label}\t{s}\n" for label, s in rows)
    print(f"wrote {len(rows)} sentences to {args.out}")


if __name__ == "__main__":
    main()
