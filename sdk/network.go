package sdk

import (
	"context"
	"net/http"
	"net/url"
	"time"
)

// UpdateNetwork replaces a sandbox's egress configuration
// (PUT /sandboxes/{id}/network, E2B's Sandbox.updateNetwork). On a running
// sandbox it is in force, and live connections it denies are cut, when
// this returns.
func (c *Client) UpdateNetwork(ctx context.Context, id string, n NetworkUpdate) error {
	if err := checkID(id); err != nil {
		return err
	}
	return c.rest(ctx, http.MethodPut, "/sandboxes/"+url.PathEscape(id)+"/network", n, nil, nil)
}

// SecretInfo is a secret's metadata (E2B's Secret); values are never
// returned.
type SecretInfo struct {
	SecretID       string            `json:"secretID"`
	Name           string            `json:"name"`
	CurrentVersion int64             `json:"currentVersion"`
	Metadata       map[string]string `json:"metadata"`
	CreatedAt      time.Time         `json:"createdAt"`
	UpdatedAt      time.Time         `json:"updatedAt"`
}

// CreateSecret stores a team secret (POST /secrets). Reference it in a
// network rule's header as SecretPlaceholder(name).
func (c *Client) CreateSecret(ctx context.Context, name, value string, metadata map[string]string) (*SecretInfo, error) {
	var out SecretInfo
	body := map[string]any{"name": name, "value": value}
	if metadata != nil {
		body["metadata"] = metadata
	}
	if err := c.rest(ctx, http.MethodPost, "/secrets", body, &out, nil); err != nil {
		return nil, err
	}
	return &out, nil
}

// UpdateSecret stores a new version of a secret (POST /secrets/{id or name}).
func (c *Client) UpdateSecret(ctx context.Context, idOrName, value string) (*SecretInfo, error) {
	var out SecretInfo
	if err := c.rest(ctx, http.MethodPost, "/secrets/"+url.PathEscape(idOrName), map[string]any{"value": value}, &out, nil); err != nil {
		return nil, err
	}
	return &out, nil
}

// GetSecret reads a secret's metadata (GET /secrets/{id or name}).
func (c *Client) GetSecret(ctx context.Context, idOrName string) (*SecretInfo, error) {
	var out SecretInfo
	if err := c.rest(ctx, http.MethodGet, "/secrets/"+url.PathEscape(idOrName), nil, &out, nil); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListSecrets lists the team's secrets (first 1000).
func (c *Client) ListSecrets(ctx context.Context) ([]SecretInfo, error) {
	var out []SecretInfo
	if err := c.rest(ctx, http.MethodGet, "/secrets?limit=1000", nil, &out, nil); err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteSecret destroys a secret (DELETE /secrets/{id or name}).
func (c *Client) DeleteSecret(ctx context.Context, idOrName string) error {
	return c.rest(ctx, http.MethodDelete, "/secrets/"+url.PathEscape(idOrName), nil, nil, nil)
}
