"""Training iterations that run through the embedded scheduler (components/scheduler).

They live in the training room because the scheduler is a lower room that never imports
training; these modules import the scheduler. See README.md.
"""
