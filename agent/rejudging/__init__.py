"""`kevo-agent replay`: a past run again. By default re-judging it (its kernels judged by today's harness);
with `--llm recorded`, re-running its decisions (the loop again, its LLM answered from the recorded
exchanges). Then against now, committed on a `replay/` branch of the run; progress saved for `--resume`.

Not here: stage 5 of the harness, also called the replay (harness/stages/replay.py); the loop
(agent.run); judging (harness).
"""
