-- The live sandboxes of one node: reconciliation lists them every pass, each node's heartbeat
-- counts them, placement joins them per node. Closed and lost rows stay as history and outnumber
-- the live ones more every day, so without this index each of those reads the whole table.
CREATE INDEX sandboxes_node_live ON sandboxes (node, state) WHERE state IN ('warm', 'leased');
