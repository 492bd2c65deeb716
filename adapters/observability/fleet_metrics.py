"""``/metrics`` of a fleet: the Prometheus expositions of the ingress and of every engine
replica merged into one, each sample labelled with where it came from (``replica``: a
replica's id, or ``ingress``). Families keep one ``# HELP`` / ``# TYPE`` header (a second
one for the same name is invalid exposition), their samples from every source beneath."""

from collections.abc import Iterable

LABEL = "replica"


def merge_expositions(parts: Iterable[tuple[str, str]]) -> str:
    """``parts``: (the ``replica`` label's value, a text exposition) pairs."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for source, text in parts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                words = line.split(maxsplit=3)
                if len(words) >= 3 and words[1] in ("HELP", "TYPE"):
                    family = words[2]
                    known = headers.setdefault(family, [])
                    if len(known) < 2 and not any(h.split()[1] == words[1] for h in known):
                        known.append(line)
                    samples.setdefault(family, [])
                continue
            samples.setdefault(family, []).append(_labelled(line, source))
    lines: list[str] = []
    for family, rows in samples.items():
        lines.extend(headers.get(family, []))
        lines.extend(rows)
    return "\n".join(lines) + "\n"


def _labelled(sample: str, source: str) -> str:
    """``sample`` with ``replica="<source>"`` first among its labels."""
    value = source.replace("\\", "\\\\").replace('"', '\\"')
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1 :]
        joiner = "" if rest.startswith("}") else ","
        return f'{sample[:brace]}{{{LABEL}="{value}"{joiner}{rest}'
    return f'{sample[:space]}{{{LABEL}="{value}"}}{sample[space:]}'
