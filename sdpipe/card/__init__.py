"""The model card: a README.md that the Hugging Face Hub reads (YAML front matter) and people read (the body).

facts.py gathers what the earlier stages wrote into one plain dict; front_matter.py and body.py turn it into text.
Nothing here loads a model: the card is written from summaries, in a second.
"""
