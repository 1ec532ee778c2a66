-- Questions an analyst asks of the gateway's store, in plain SQL over its tables and views (docs/sql.md).
-- Each runs as it is on SQLite and PostgreSQL, for instance:
--   sqlite3 -header -column gateway.db < examples/analyst.sql
--   psql postgresql://USER@HOST/DB -f examples/analyst.sql

-- Rewards per policy version: the rewarded rollouts, by the version their first turn was sampled at.
SELECT t.policy_version, COUNT(*) AS rollouts, AVG(r.reward) AS reward_mean,
       MIN(r.reward) AS reward_min, MAX(r.reward) AS reward_max
FROM rollouts r JOIN turns t ON t.rollout_id = r.rollout_id AND t.turn_index = 0
WHERE r.reward IS NOT NULL AND NOT r.eval
GROUP BY t.policy_version
ORDER BY t.policy_version;

-- Drift per model: of the turns that extend an earlier one, those whose history, rendered again, does not
-- reproduce the ids the model produced (in exact mode, the drift the splice onto those ids avoided).
SELECT model, turns, extending_turns, drifted_turns, drift_rate, forked_turns
FROM drift_by_model
ORDER BY model;

-- Groups waiting, the oldest first: members still running, or fewer members finished than the group declared
-- (group_size). A trainer takes a group once it has neither (or at its group_timeout, with what finished).
SELECT group_id, group_size, rollouts AS created, finished, first_created_at
FROM group_stats
WHERE finished < rollouts OR finished < group_size
ORDER BY first_created_at, group_id;
