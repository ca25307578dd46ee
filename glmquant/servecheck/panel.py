"""The held-out text panel of the fidelity gate: passages written for glmquant, in no calibration recipe.

Mixed on purpose (prose, science, code, data, maths, dialogue, six languages) because quantization
error concentrates on whatever the calibration under-covered. The passages are tokenized end to end
(joined by blank lines) and cut into rows of equal length.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glmquant.errors import UsageError
from glmquant.servecheck.tokens import PromptTokenizer, ServerTokenizer

PASSAGES = (
    """The ferry left the island an hour late because the harbour crane had jammed while lifting a crate of \
roof tiles. Nobody on board seemed to mind. A retired schoolteacher unfolded a paper map across two seats and \
traced the coastline with her finger, naming every cove she had swum in as a girl. Two students argued about \
whether the gulls following the boat were hungry or simply curious, and a man in a wool cap slept through the \
whole crossing with a loaf of bread under his arm. When the mainland finally appeared, low and grey behind the \
rain, the teacher folded her map along its old creases and said that the town had not changed in forty years, \
which was not true, but everyone nodded anyway.""",
    """Photosynthesis in most plants happens in two linked stages. In the light-dependent reactions, pigments in \
the thylakoid membranes absorb photons and use that energy to split water, releasing oxygen and producing ATP \
and NADPH. In the Calvin cycle, which takes place in the stroma, the enzyme RuBisCO fixes carbon dioxide onto \
a five-carbon sugar; the ATP and NADPH from the first stage then reduce the products into three-carbon sugars \
that the cell can export or store as starch. RuBisCO is slow and sometimes grabs oxygen instead of carbon \
dioxide, a wasteful side reaction called photorespiration. Plants in hot, dry climates have evolved C4 and CAM \
pathways that concentrate carbon dioxide around the enzyme and reduce this loss.""",
    '''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals; the result is sorted by start."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


if __name__ == "__main__":
    print(merge_intervals([(5, 8), (1, 3), (2, 4), (10, 12), (7, 9)]))''',
    """SELECT c.region, COUNT(DISTINCT o.customer_id) AS buyers, SUM(o.total) AS revenue
FROM orders AS o
JOIN customers AS c ON c.id = o.customer_id
WHERE o.placed_at >= DATE '2024-01-01' AND o.status <> 'cancelled'
GROUP BY c.region
HAVING SUM(o.total) > 10000
ORDER BY revenue DESC;
{"region": "north", "buyers": 412, "revenue": 58210.75, "currency": "EUR", "complete": true}""",
    """Claim: for every integer n >= 1, the sum 1 + 3 + 5 + ... + (2n - 1) equals n squared. Proof by \
induction. For n = 1 the sum is 1, which is 1 squared. Suppose the claim holds for some n, so the first n odd \
numbers add up to n^2. The next odd number is 2n + 1, and n^2 + 2n + 1 = (n + 1)^2, so the claim holds for \
n + 1 as well. Geometrically, each odd number adds an L-shaped border of 2n + 1 unit squares to an n by n \
square, turning it into an (n + 1) by (n + 1) square. The same picture explains why consecutive squares \
differ by consecutive odd numbers: 4 - 1 = 3, 9 - 4 = 5, 16 - 9 = 7.""",
    """"Did you lock the back door?" she asked, already halfway down the stairs.
"I think so. I remember turning the key, but that might have been yesterday."
"That is exactly the kind of answer that makes me go and check."
"Then check. I will start the car and we will still be on time if the traffic behaves."
"The traffic never behaves on a Friday."
"Then we will be late together, which is the next best thing to being on time alone."
She laughed, checked the door, found it locked, and said nothing about it for the whole drive.""",
    """Die alte Mühle am Rand des Dorfes steht seit über zweihundert Jahren. Früher mahlte sie das Korn der \
umliegenden Höfe, heute beherbergt sie ein kleines Museum, in dem Kinder lernen, wie aus Weizen Mehl wird. \
Im Frühjahr, wenn der Bach viel Wasser führt, dreht sich das große Rad noch einmal für die Besucher, und der \
Geruch von nassem Holz und frischem Brot zieht über die Wiese. Der Verein, der die Mühle pflegt, sucht \
jedes Jahr neue Freiwillige, denn die Arbeit an den Zahnrädern und Schaufeln hört nie auf.""",
    """Le marché du samedi commence bien avant le lever du soleil. Les maraîchers installent leurs tréteaux à \
la lumière des lampes frontales, empilent les cagettes de poireaux et de pommes, et échangent les nouvelles \
de la semaine en buvant un café trop chaud. Vers huit heures arrivent les premiers clients, souvent les mêmes, \
qui savent déjà quel étal vend les meilleures fraises et lequel garde toujours un peu de fromage de chèvre \
pour les habitués. À midi, il ne reste que quelques feuilles de salade sur les pavés.""",
    """La biblioteca del barrio abrió una sala nueva dedicada a los mapas antiguos. Hay cartas náuticas del \
siglo dieciocho, planos de la ciudad dibujados a mano y un globo terráqueo que todavía muestra países que ya \
no existen. Los sábados por la mañana, una voluntaria explica a los visitantes cómo se medía la longitud en \
alta mar antes de que existieran relojes fiables, y por qué tantos barcos terminaban lejos de donde creían \
estar.""",
    """城市东边的老茶馆每天早上六点开门。常来的客人大多是附近的退休工人，\
他们带着自己的茶杯，坐在靠窗的位置，一边喝茶一边下象棋。\
老板记得每个人喜欢的茶叶，也记得谁的孙子今年考上了大学。\
到了中午，茶馆里渐渐安静下来，只剩下收音机里低低的戏曲声和窗外偶尔经过的自行车铃声。""",
    """Na skraju lasu stoi mała stacja meteorologiczna, którą od trzydziestu lat obsługuje ta sama rodzina. \
Co rano o siódmej ktoś odczytuje temperaturę, ciśnienie i wysokość opadów, a wyniki zapisuje w grubym \
zeszycie, zanim wyśle je do instytutu. Dzięki tym notatkom wiadomo dziś, że zimy w okolicy stały się \
krótsze, a wiosenne przymrozki przychodzą coraz rzadziej.""",
    """Recipe for a plain lentil soup: rinse 250 g of red lentils until the water runs clear. Soften one \
chopped onion and two cloves of garlic in olive oil over low heat for about eight minutes, then stir in a \
teaspoon of ground cumin. Add the lentils, one litre of vegetable stock and a chopped carrot, bring to a boil \
and simmer for twenty minutes, until the lentils fall apart. Season with salt, pepper and the juice of half a \
lemon, and blend part of the soup if you prefer it smooth.""",
)


def panel_ids(
    tokenizer: PromptTokenizer | ServerTokenizer, rows: int, tokens: int, text_file: Path | None = None
) -> torch.Tensor:
    """The panel (or `text_file`) as token ids [rows, tokens] (LongTensor), cut from its start."""
    if text_file is None:
        text = "\n\n".join(PASSAGES)
    else:
        try:
            text = text_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{text_file}: cannot read the panel text ({exc})") from None
    ids = tokenizer.encode(text)
    if len(ids) < rows * tokens:
        raise UsageError(
            f"the fidelity panel ({text_file or 'built-in'}) holds {len(ids)} tokens of this tokenizer; "
            f"--panel-rows x --panel-tokens = {rows} x {tokens} asks for more"
        )
    return torch.tensor(ids[: rows * tokens], dtype=torch.long).view(rows, tokens)
