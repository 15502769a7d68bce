"""Tasks at run time: their examples and reward functions and the mixer that fills each step
(`task`), the curriculum that changes the tasks' shares (`curriculum`), and the context every
phase works on (`context`).

Nothing is imported here: the config's sections import `tasks.curriculum`, and `tasks.task`
imports the config."""
