"""The live trace and its interventions: one prompt through the model, every layer's memories and residual
read out (`trace`), memories switched off or scaled (`interventions`, `edited_forward`), who pushed a token
(`attribution`), a prompt's memory circuit (`circuit`), one key over any text (`key_coefficients`); what
the live worker is asked and answers, and the limits (`protocol`)."""
