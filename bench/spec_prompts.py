"""`tinyhet bench spec`'s fixed prompts: copy-heavy ones (a passage of ~400 tokens to rewrite with a small edit: the answer
quotes its prompt, where n-gram drafting pays) and free chat ones (little to quote). Each is one user message, rendered
in the model's chat template by the benchmark."""

PASSAGES = (
  "The lighthouse on the northern cape was built in 1871, after three ships were lost on the rocks in a single winter. "
  "Its tower is forty metres of grey granite, cut from a quarry two valleys inland and carried to the coast on carts "
  "pulled by oxen. For more than a hundred years a keeper lived in the small house at its foot with his family. Every "
  "evening he climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them again to "
  "clean the lens and trim the wick. In storms he stayed at the top all night, watching the beam sweep across the water "
  "and listening for the horns of ships that had lost their way. The keepers kept a log of every ship they saw, every "
  "storm and every repair, and the logs are now kept in the town museum, where visitors can read them in the keepers' "
  "own handwriting. In 1968 the lamp was replaced by an electric light that turns on by itself at dusk, and the last "
  "keeper moved to the town. The house stood empty for many years, its windows broken and its garden overgrown. Today a "
  "small trust looks after the tower and the house. Volunteers repaint the railings every spring, repair the roof after "
  "the winter storms and guide visitors up the steps on summer weekends. From the gallery at the top, on a clear day, "
  "you can see the islands to the west and the mountains to the south, and in the autumn you can watch the seabirds "
  "gather on the cliffs before they fly south for the winter.",
  "Our bakery opens at six in the morning, but the work starts long before that. At two o'clock the first baker arrives, "
  "switches on the ovens and takes the dough out of the cold room, where it has rested overnight. The sourdough is "
  "shaped by hand into round loaves and long loaves, dusted with flour and left to rise in baskets lined with linen. "
  "While it rises, the second baker makes the croissant dough, folding cold butter into it again and again until it has "
  "dozens of thin layers. At four o'clock the bread goes into the oven, with a little water poured onto the hot stones "
  "to make steam, which gives the crust its shine. The croissants follow, then the rolls, then the cakes for the "
  "afternoon. By half past five the shelves are full and the shop smells of warm bread and butter. The first customers "
  "are usually the same: a nurse coming home from the night shift, two builders on their way to a site across the "
  "river, and an old man who buys one small rye loaf every day and pays with exact change. At midday the bakers go home "
  "to sleep, and the shop staff sell what is left. Anything that is not sold by closing time is given to the shelter "
  "down the street, so nothing goes to waste. On Sundays the bakery is closed, and the ovens cool down for the only time "
  "in the week. On Monday at two o'clock the first baker arrives again, switches them on and starts the next week.",
  "The river that runs through the city was once so polluted that no fish could live in it. Factories along its banks "
  "poured their waste straight into the water, and the sewers of the old town emptied into it after every heavy rain. "
  "In summer it smelled so bad that people kept their windows shut. Forty years ago the city council decided to clean "
  "it up. New laws forced the factories to treat their waste, and a large treatment plant was built downstream to clean "
  "the water from the sewers before it reached the river. The work took more than twenty years and cost a great deal of "
  "money, and many people doubted that it would ever succeed. Slowly the water became clearer. First the insects came "
  "back, then the small fish that eat them, and then the larger fish that eat the small ones. Ten years ago a family of "
  "otters was seen near the old stone bridge for the first time in a century, and the local newspaper printed the "
  "photograph on its front page. Today people swim in the river on hot days, children fish from the banks, and a rowing "
  "club trains on the long straight stretch below the park. The old factory buildings have become flats, offices and a "
  "market, and a path for walkers and cyclists follows the river for twelve kilometres out into the countryside. Every "
  "year in June the city holds a festival on the water to remember how the river was saved.",
)

EDITS = (
  "Rewrite the following passage exactly as it is, but change every number to words where it is written in digits.",
  "Rewrite the following passage word for word, but put it in the present tense.",
  "Copy the following passage, changing only the first sentence so that it is more exciting. Keep the rest unchanged.",
  "Rewrite the following passage with small edits: fix any awkward wording, but keep every sentence and its order.",
)

COPY = tuple(f"{edit}\n\n{passage}" for passage in PASSAGES for edit in EDITS)

CHAT = (
  "What are three good ways to learn a new language as an adult?",
  "Write a short poem about a cat watching the rain.",
  "Explain why the sky is blue to a ten-year-old.",
  "Give me a simple recipe for a vegetable soup.",
  "What should I pack for a three-day hiking trip in the mountains?",
  "Tell me a short story about a robot who wants to become a gardener.",
  "How do I politely decline an invitation to a party?",
  "What is the difference between weather and climate?",
  "Suggest five names for a small bookshop by the sea.",
  "How can I sleep better at night?",
  "Describe a busy market in the morning in a few sentences.",
  "What are the main causes of the seasons on Earth?",
  "Write a friendly email asking a neighbour to water my plants.",
  "Why do leaves change colour in the autumn?",
  "Give me three tips for keeping a kitchen tidy.",
  "Explain what a computer's memory is used for.",
)

TASKS = {"copy": COPY, "chat": CHAT}
