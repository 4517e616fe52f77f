//! Supervision of the daemon's long-running tasks (sync loops, API watches).
//!
//! Each of them runs until shutdown. One that ends earlier — it returned, failed or
//! panicked — leaves the node half served: a dead sync loop stops a family's rules from
//! following the cluster while `/livez` may still look fine for a while. Upstream's goroutines
//! end the process in that case (`klog.Fatal`, or a crash); [`Tasks`] gives the daemon the same
//! behaviour: the first task to end before shutdown is reported as a [`TaskEnded`], and the
//! daemon exits with it as its error so the DaemonSet restarts the pod.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{Id, JoinSet};

use crate::daemon::sync_loop::panic_message;

/// A supervised task ended before shutdown, and how.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{task} ended unexpectedly: {how}")]
pub struct TaskEnded {
    /// The task's name, as given to [`Tasks::spawn`].
    pub task: String,
    pub how: String,
}

/// A set of named tasks that must run until shutdown.
#[derive(Default)]
pub(crate) struct Tasks {
    set: JoinSet<Result<(), String>>,
    names: HashMap<Id, String>,
}

impl Tasks {
    pub fn new() -> Self {
        Tasks::default()
    }

    /// Spawns `task` under `name`. Its `Err` is reported as the reason it ended.
    pub fn spawn<F>(&mut self, name: impl Into<String>, task: F)
    where
        F: Future<Output = Result<(), String>> + Send + 'static,
    {
        let handle = self.set.spawn(task);
        self.names.insert(handle.id(), name.into());
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Waits for the next task to end and says how it ended; `None` once every task has.
    pub(crate) async fn next_ended(&mut self) -> Option<TaskEnded> {
        let (id, how) = match self.set.join_next_with_id().await? {
            Ok((id, Ok(()))) => (id, "returned".to_string()),
            Ok((id, Err(e))) => (id, format!("failed: {e}")),
            Err(e) => {
                let id = e.id();
                let how = if e.is_panic() {
                    format!("panicked: {}", panic_message(e.into_panic()))
                } else {
                    "was cancelled".to_string()
                };
                (id, how)
            }
        };
        let task = self.names.remove(&id).unwrap_or_else(|| "a task".to_string());
        Some(TaskEnded { task, how })
    }

    /// Waits for the first task to end. Never completes while every task runs (or if there
    /// are none), so it can sit in a `select!` beside the shutdown signal.
    pub(crate) async fn first_ended(&mut self) -> TaskEnded {
        match self.next_ended().await {
            Some(ended) => ended,
            None => std::future::pending().await,
        }
    }

    /// Waits for every remaining task to end (after shutdown was signalled).
    pub(crate) async fn join_all(&mut self) {
        while let Some(ended) = self.next_ended().await {
            if ended.how != "returned" {
                tracing::warn!(task = %ended.task, how = %ended.how, "task ended with an error during shutdown");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn the_first_task_to_end_is_named_with_how_it_ended() {
        let mut tasks = Tasks::new();
        tasks.spawn("watch", std::future::pending());
        tasks.spawn("sync loop IPv4", async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            panic!("render state poisoned")
        });
        let ended = tasks.first_ended().await;
        assert_eq!(ended, TaskEnded { task: "sync loop IPv4".into(), how: "panicked: render state poisoned".into() });
        assert_eq!(ended.to_string(), "sync loop IPv4 ended unexpectedly: panicked: render state poisoned");

        let mut tasks = Tasks::new();
        tasks.spawn("a", async { Err("client gone".to_string()) });
        assert_eq!(tasks.first_ended().await.how, "failed: client gone");
        let mut tasks = Tasks::new();
        let n = 7;
        tasks.spawn("b", async move {
            if n > 0 {
                panic!("formatted {n}")
            }
            Ok(())
        });
        tasks.spawn("c", async { Ok(()) });
        let mut hows: Vec<_> =
            [tasks.first_ended().await, tasks.first_ended().await].into_iter().map(|e| e.how).collect();
        hows.sort();
        assert_eq!(hows, ["panicked: formatted 7", "returned"]);
        assert!(tasks.is_empty());
    }

    #[tokio::test]
    async fn first_ended_waits_while_every_task_runs() {
        let mut tasks = Tasks::new();
        tasks.spawn("forever", std::future::pending());
        let waited = tokio::time::timeout(Duration::from_millis(50), tasks.first_ended()).await;
        assert!(waited.is_err(), "no task ended, so nothing is reported");
        let mut none = Tasks::new();
        assert!(tokio::time::timeout(Duration::from_millis(10), none.first_ended()).await.is_err());
        assert_eq!(none.next_ended().await, None);
    }
}
