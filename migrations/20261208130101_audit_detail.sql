-- What an operator's change was, for the audit events that record one (issue 29: `sandgate admin
-- tenant egress` and `admin tenant secret`, e.g. "allow api.shop.test:443" or "set SHOP_TOKEN
-- v1 hosts api.shop.test headers authorization"; never a secret's value). NULL for tool calls.
-- Expand only: a nullable column, which older binaries neither read nor write.
ALTER TABLE audit_events ADD COLUMN detail text;
