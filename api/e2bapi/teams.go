package e2bapi

import "time"

// Teams, API keys and access tokens (E2B's /teams, /api-keys,
// /access-tokens). Keys and tokens are shown once, in the creation
// response; afterwards only their mask.

// Team is one of the caller's teams. APIKey is always "": keys are never
// readable after their creation.
type Team struct {
	TeamID    string `json:"teamID"`
	Name      string `json:"name"`
	APIKey    string `json:"apiKey"`
	IsDefault bool   `json:"isDefault"`
}

// NewTeam is POST /teams.
type NewTeam struct {
	Name string `json:"name"`
}

// TeamUser names a user (the creator of a key).
type TeamUser struct {
	ID    string  `json:"id"`
	Email *string `json:"email"`
}

// IdentifierMaskingDetails is what is shown of a key or token.
type IdentifierMaskingDetails struct {
	Prefix            string `json:"prefix"`
	ValueLength       int    `json:"valueLength"`
	MaskedValuePrefix string `json:"maskedValuePrefix"`
	MaskedValueSuffix string `json:"maskedValueSuffix"`
}

// TeamAPIKey is a listed API key. Role is SPACE's ("admin" or "user").
type TeamAPIKey struct {
	ID        string                   `json:"id"`
	Name      string                   `json:"name"`
	Mask      IdentifierMaskingDetails `json:"mask"`
	CreatedAt time.Time                `json:"createdAt"`
	CreatedBy *TeamUser                `json:"createdBy"`
	LastUsed  *time.Time               `json:"lastUsed"`
	Role      string                   `json:"role,omitempty"`
}

// CreatedTeamAPIKey is POST /api-keys' answer: the key, this once.
type CreatedTeamAPIKey struct {
	ID        string                   `json:"id"`
	Key       string                   `json:"key"`
	Name      string                   `json:"name"`
	Mask      IdentifierMaskingDetails `json:"mask"`
	CreatedAt time.Time                `json:"createdAt"`
	CreatedBy *TeamUser                `json:"createdBy"`
	LastUsed  *time.Time               `json:"lastUsed"`
	Role      string                   `json:"role,omitempty"`
}

// NewTeamAPIKey is POST /api-keys. Role (SPACE's) defaults to "admin", E2B's
// only kind of key.
type NewTeamAPIKey struct {
	Name string `json:"name"`
	Role string `json:"role,omitempty"`
}

// UpdateTeamAPIKey is PATCH /api-keys/{apiKeyID}.
type UpdateTeamAPIKey struct {
	Name string `json:"name"`
}

// NewAccessToken is POST /access-tokens.
type NewAccessToken struct {
	Name string `json:"name"`
}

// AccessToken is a listed access token.
type AccessToken struct {
	ID        string                   `json:"id"`
	Name      string                   `json:"name"`
	Mask      IdentifierMaskingDetails `json:"mask"`
	CreatedAt time.Time                `json:"createdAt"`
}

// CreatedAccessToken is POST /access-tokens' answer: the token, this once.
type CreatedAccessToken struct {
	ID        string                   `json:"id"`
	Name      string                   `json:"name"`
	Token     string                   `json:"token"`
	Mask      IdentifierMaskingDetails `json:"mask"`
	CreatedAt time.Time                `json:"createdAt"`
}

// TeamMember is a user's membership (SPACE: GET /teams/{teamID}/users).
type TeamMember struct {
	ID    string `json:"id"`
	Email string `json:"email"`
	Role  string `json:"role"`
}

// NewTeamMember adds a member (SPACE: POST /teams/{teamID}/users): a new
// user, labelled by Email, or an existing one by UserID (exactly one).
type NewTeamMember struct {
	Email  string `json:"email,omitempty"`
	UserID string `json:"userID,omitempty"`
	Role   string `json:"role,omitempty"`
}

// InvitedTeamMember answers an invitation: a new user comes with a first
// access token, shown this once (hand it to them).
type InvitedTeamMember struct {
	TeamMember
	AccessToken *CreatedAccessToken `json:"accessToken,omitempty"`
}
