//! Placement: which node a new lease goes to, warm or cold, decided here by one rule
//! (docs/architecture.md, "Placement").
//!
//! The rule ([`OwnFirstThenMostRoom`]): only a live, non-draining node with room (slots minus
//! its leased sandboxes) takes a lease; among those, this process's own node comes first, then
//! the one with the most room; ties go to the first by name, then id. A warm lease takes a warm
//! row on the first node of that order that has one (the store's `lease_warm` is given the
//! order); a cold start goes to the first node of the order. A warm sandbox anywhere in the
//! order wins over a cold start on a node before it: it costs no start.
//!
//! The rule is behind a small interface ([`Algorithm`], as e2b's placement is) so another can
//! replace it in one place; every lease, warm or cold, asks [`choose`].

use sandgate_store::nodes::{self, NodeLoad};
use sandgate_store::{PgConnection, StoreError};

/// A placement rule: orders the nodes that may take a lease now.
pub trait Algorithm: std::fmt::Debug + Send + Sync {
    /// The ids of the nodes of `loads` (the live, non-draining nodes with their leased counts,
    /// ordered by name, then id) that may take a lease, best first. `own` is this process's own
    /// node's id, if it runs one.
    fn rank(&self, loads: &[NodeLoad], own: Option<&str>) -> Vec<String>;
}

/// sandgate's rule: nodes with room only; this process's own node first, then the most room;
/// ties to the first listed.
#[derive(Debug, Clone, Copy, Default)]
pub struct OwnFirstThenMostRoom;

/// A node's room for new leases: its slots minus its leased sandboxes.
fn room(load: &NodeLoad) -> i64 {
    i64::from(load.node.slots) - load.leased
}

impl Algorithm for OwnFirstThenMostRoom {
    fn rank(&self, loads: &[NodeLoad], own: Option<&str>) -> Vec<String> {
        let mut with_room: Vec<&NodeLoad> = loads.iter().filter(|l| room(l) > 0).collect();
        // A stable sort keeps the listed order among equals.
        with_room.sort_by_key(|l| (Some(l.node.id.as_str()) != own, -room(l)));
        with_room.into_iter().map(|l| l.node.id.clone()).collect()
    }
}

/// Where a lease may go: the nodes in the rule's order, and what there is when none may.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The nodes that may take the lease, best first (see [`Algorithm::rank`]).
    pub order: Vec<String>,
    /// How many live, non-draining nodes there are (with room or not).
    pub nodes: usize,
    /// Their slots, together.
    pub slots: i64,
}

/// Where a cold start goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// On this node (its registry id).
    On(String),
    /// No live, non-draining node has room: `nodes` such nodes with `slots` in all, all used.
    Full {
        /// How many live, non-draining nodes there are.
        nodes: usize,
        /// Their slots, together.
        slots: i64,
    },
}

impl Choice {
    /// Ranks `loads` by `rule`.
    pub fn new(rule: &dyn Algorithm, loads: &[NodeLoad], own: Option<&str>) -> Self {
        Self {
            order: rule.rank(loads, own),
            nodes: loads.len(),
            slots: loads.iter().map(|l| i64::from(l.node.slots)).sum(),
        }
    }

    /// Where a cold start goes: the first node of the order.
    pub fn cold(&self) -> Placement {
        match self.order.first() {
            Some(id) => Placement::On(id.clone()),
            None => Placement::Full {
                nodes: self.nodes,
                slots: self.slots,
            },
        }
    }
}

/// Reads the nodes that may take leases now (heartbeat within `away_after_seconds`: an away
/// node takes no new lease; not draining, with their leased counts) on `conn` (a lease's transaction, for a warm lease) and
/// ranks them by `rule`.
pub async fn choose(
    conn: &mut PgConnection,
    rule: &dyn Algorithm,
    own: Option<&str>,
    away_after_seconds: i64,
) -> Result<Choice, StoreError> {
    let loads = nodes::placeable(conn, away_after_seconds).await?;
    Ok(Choice::new(rule, &loads, own))
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use sandgate_store::nodes::NodeRow;

    use super::*;

    fn load(id: &str, slots: i32, leased: i64) -> NodeLoad {
        NodeLoad {
            node: NodeRow {
                id: id.into(),
                name: format!("host-{id}"),
                advertise_url: format!("https://{id}:7443"),
                slots,
                memory_bytes: 0,
                live_sandboxes: 0,
                ready_sandboxes: 0,
                draining: false,
                process: uuid::Uuid::nil(),
                heartbeat_at: Utc::now(),
                started_at: Utc::now(),
            },
            leased,
        }
    }

    fn choose(loads: &[NodeLoad], own: Option<&str>) -> Choice {
        Choice::new(&OwnFirstThenMostRoom, loads, own)
    }

    #[test]
    fn the_own_node_is_preferred_while_it_has_room() {
        let loads = [load("a", 10, 0), load("own", 4, 3)];
        let choice = choose(&loads, Some("own"));
        assert_eq!(
            choice.cold(),
            Placement::On("own".into()),
            "one slot left on the own node is enough"
        );
        assert_eq!(choice.order, ["own", "a"], "then the others, warm or cold");
    }

    #[test]
    fn a_full_own_node_sends_the_lease_to_the_node_with_most_room() {
        let loads = [load("own", 4, 4), load("b", 10, 8), load("c", 6, 1)];
        let choice = choose(&loads, Some("own"));
        assert_eq!(choice.cold(), Placement::On("c".into()));
        assert_eq!(
            choice.order,
            ["c", "b"],
            "a full node takes no lease, not even a warm one"
        );
    }

    #[test]
    fn without_an_own_node_the_most_room_wins_and_ties_go_to_the_first() {
        let loads = [load("a", 5, 2), load("b", 6, 3), load("c", 2, 0)];
        let choice = choose(&loads, None);
        assert_eq!(choice.cold(), Placement::On("a".into()));
        assert_eq!(choice.order, ["a", "b", "c"]);
    }

    #[test]
    fn no_room_anywhere_is_full_with_the_numbers() {
        let loads = [load("a", 2, 2), load("b", 3, 5)];
        let choice = choose(&loads, Some("a"));
        assert_eq!(choice.cold(), Placement::Full { nodes: 2, slots: 5 });
        assert!(choice.order.is_empty(), "no warm lease either: {choice:?}");
        assert_eq!(
            choose(&[], None).cold(),
            Placement::Full { nodes: 0, slots: 0 }
        );
    }

    #[test]
    fn an_own_node_that_is_not_placeable_is_not_chosen() {
        // `loads` holds only live, non-draining nodes: a draining own node is absent.
        let loads = [load("b", 3, 1)];
        assert_eq!(
            choose(&loads, Some("own")).cold(),
            Placement::On("b".into())
        );
    }
}
